"""What a training pass keeps for backward (lathe.kernels.activations): less memory, the same bits."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lathe.kernels.activations import recomputed, swiglu
from lathe.models.decoder import Decoder, Packed
from lathe.models.lora_batch import LoraBatch
from tests.test_trainer_numerics import _adapter


def _saved_count(fn, *args: torch.Tensor) -> tuple[int, torch.Tensor]:  # noqa: ANN001
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return count, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_keeps_its_two_inputs_and_gives_autograds_gradient_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(37, 96, generator=gen).to(dtype) for _ in range(3))
    got, ref = [], []
    for fn, into in ((swiglu, got), (lambda g, u: torch.nn.functional.silu(g) * u, ref)):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        saved, h = _saved_count(fn, g, u)
        h.backward(grad)
        into += [saved, h, g.grad, u.grad]
    assert got[0] == 2 and ref[0] == 3  # gate and up; autograd also kept silu(gate)
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert torch.equal(a, b)


def test_recomputed_drops_the_tensor_and_backward_reads_its_views_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 40, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(40, 8, generator=gen, requires_grad=True)

    def loss(drop: bool) -> tuple[torch.Tensor, weakref.ref]:
        xf = x.float()
        with recomputed(xf, lambda: x.float()) if drop else torch.enable_grad():
            y = ((xf[2:] @ w) * xf[2:, :8]).sum()  # views of xf at an offset, saved by mm and mul
        return y, weakref.ref(xf)

    grads = []
    for drop in (True, False):
        x.grad = w.grad = None
        y, ref = loss(drop)
        gc.collect()
        assert (ref() is None) == drop  # recomputed: nothing in the graph holds the wide copy
        y.backward()
        grads.append((x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_recomputed_refuses_a_strided_tensor() -> None:
    t = torch.zeros(4, 6, requires_grad=True).t()
    with pytest.raises(ValueError, match=r"must be contiguous \(shape \(6, 4\), strides \(1, 6\)\)"), \
            recomputed(t, t.contiguous):
        pass


class _Outputs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _alive_after_forward(model: Decoder, lengths: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The tensors a training pass of two adapters over sequences of ``lengths`` holds for backward, and its
    output."""
    seg = [0, lengths[0], sum(lengths)]
    lora = LoraBatch(seg, [0, 1], [_adapter(model, 4, 1), _adapter(model, 8, 2)], invariant=True)
    with _Outputs() as outputs:
        h = model.hidden(Packed.from_sequences([list(range(3, 3 + n)) for n in lengths]), lora)
    gc.collect()
    return list({t.untyped_storage().data_ptr(): t for t in (r() for r in outputs.refs) if t is not None}.values()), h


def test_a_pass_keeps_no_rmsnorm_output_for_the_linears_after_it(tiny_dir) -> None:  # noqa: ANN001
    """Between forward and backward, of the [T, hidden] activations an fp32 pass keeps only the embedding, each
    layer's attention output and two residual sums, and the final norm's output (the LM head's input): the linears
    after each layer's two RMSNorms (and their adapters) no longer keep the norm's output, which backward rebuilds
    from the norm's input (a layer kept five before)."""
    model = Decoder.from_dir(tiny_dir)
    alive, h = _alive_after_forward(model, (21, 40))
    wide = [t for t in alive if tuple(t.shape) == (61, model.cfg.hidden_size)]
    assert len(wide) == 3 * model.cfg.num_layers + 2, [t.grad_fn for t in wide]
    assert h.requires_grad


def test_a_checkpointed_pass_keeps_no_layers_activations(tiny_dir) -> None:  # noqa: ANN001
    """Under activation checkpointing no rebuild block opens inside a layer (its saved-tensor hooks would stand in
    for checkpointing's, and keep what checkpointing drops): no MLP activation is held between forward and
    backward (a SwiGLU rebuild's closure held gate and up), and of the [T, hidden] ones only the embedding, each
    layer's input and the final norm's output (the RMSNorm rebuilds kept every tensor their layers saved)."""
    model = Decoder.from_dir(tiny_dir, checkpoint_layers=True)
    alive, h = _alive_after_forward(model, (21, 40))
    cfg = model.cfg
    assert [t.grad_fn for t in alive if tuple(t.shape) == (61, cfg.intermediate_size)] == []
    wide = [t.grad_fn for t in alive if tuple(t.shape) == (61, cfg.hidden_size)]
    assert len(wide) == cfg.num_layers + 2, wide
    assert h.requires_grad


def test_a_bf16_pass_keeps_no_wide_copy_and_two_mlp_activations_a_layer(tiny_dir) -> None:  # noqa: ANN001
    """Between forward and backward of a bf16 pass with two adapters, the graph holds no fp32 copy of an
    activation (it held one per RMSNorm and per LoRA target's input) and, of the MLP, gate and up only (it held
    silu(gate) and the product too)."""
    model = Decoder.from_dir(tiny_dir, dtype=torch.bfloat16)
    lengths = (21, 40)
    alive, h = _alive_after_forward(model, lengths)
    rows, cfg = sum(lengths), model.cfg
    wide = [tuple(t.shape) for t in alive if t.dtype == torch.float32 and t.numel() >= rows * cfg.hidden_size]
    assert wide == []
    mlp = [t for t in alive if t.dim() == 2 and tuple(t.shape) == (rows, cfg.intermediate_size)]
    assert len(mlp) == 2 * cfg.num_layers
    assert h.requires_grad
