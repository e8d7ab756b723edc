"""The SGMV/BGMV Triton kernels under Triton's interpreter, against the torch reference.

Run by ``tests/test_sgmv_triton.py::test_kernels_under_interpreter`` in a child pytest process with
TRITON_INTERPRET=1 (the variable must be set before the kernels are first defined). Interpreted dots use
fp32 and fp16 only (the interpreter gets bf16 dots wrong). References are computed in float64; every
kernel writes into a NaN-filled buffer so a row or slot it fails to write shows up.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from lathe.kernels import lora
from lathe.kernels import sgmv_triton as st

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module with TRITON_INTERPRET=1 (tests/test_sgmv_triton.py does)")

TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32 kernel vs float64 reference, outputs of order 1


# --- interpreted kernels -----------------------------------------------------------------------

# (T, H, D, R, N, layout) with D the output width (O in the kernel docstrings); layout is (seg, ids), or
# (segments, slots used, seed) for a random one, which holds an empty segment and repeats slots
CASES = {
    "random": (64, 40, 72, 8, 4, (7, 4, 0)),
    "unused-slot": (37, 72, 40, 12, 4, (6, 3, 1)),  # slot 3 owns no tokens: its gradients must be zeros
    "only-last-nonempty": (20, 40, 40, 12, 4, ([0, 0, 0, 20], [3, 1, 0])),
    "one-long-segment": (50, 72, 72, 16, 2, ([0, 50], [1])),  # longer than a token block
    "wide": (40, 200, 136, 12, 3, (4, 3, 2)),  # several reduction steps and column blocks, ragged last ones
}


def _layout(T: int, spec: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment starts and slots; a random layout forces one empty segment and has S > slots."""
    if isinstance(spec[0], list):
        return torch.tensor(spec[0]), torch.tensor(spec[1])
    S, slots, seed = spec
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randint(0, T + 1, (S - 1,), generator=gen).sort().values
    inner[S // 2] = inner[S // 2 - 1]
    seg = torch.cat([torch.tensor([0]), inner, torch.tensor([T])])
    return seg, torch.randint(0, slots, (S,), generator=gen)


def _problem(T: int, H: int, D: int, R: int, N: int, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    """x, A, B, scale and an upstream gradient dy, scaled so that every output is of order 1."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(T, H, generator=gen).to(dtype),
        "A": (torch.randn(N, R, H, generator=gen) / H**0.5).to(dtype),
        "B": (torch.randn(N, D, R, generator=gen) / R**0.5).to(dtype),
        "scale": torch.rand(N, generator=gen) + 0.5,
        "dy": (torch.randn(T, D, generator=gen) / T**0.5).to(dtype),
    }


def _nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"))


def _grads64(
    fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn's output and the gradients of (output * dy).sum() with respect to inputs, in float64."""
    leaves = [t.double().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy.double())
    return y.detach(), [t.grad for t in leaves]


class TestInterpreted:
    def test_triton_available(self) -> None:
        assert st.triton_available()

    @pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
    def test_shrink_and_expand_match_reference(self, case: tuple) -> None:
        T, H, D, R, N, layout = case
        seg, ids = _layout(T, layout)
        p = _problem(T, H, D, R, N, seed=T)
        v64 = lora.lora_shrink(p["x"].double(), p["A"].double(), seg, ids)
        y64 = lora.lora_expand(v64, p["B"].double(), seg, ids, p["scale"].double())
        v = st.sgmv_shrink(p["x"], p["A"], seg, ids, out=_nan(T, R))
        torch.testing.assert_close(v, v64.float(), **TOL)
        v = v64.float()
        torch.testing.assert_close(st.sgmv_expand(v, p["B"], seg, ids, p["scale"]), y64.float(), **TOL)
        set_out = st.sgmv_expand(v, p["B"], seg, ids, p["scale"], _nan(T, D), add=False)
        torch.testing.assert_close(set_out, y64.float(), **TOL)
        base = torch.randn(T, D)
        added = st.sgmv_expand(v, p["B"], seg, ids, p["scale"], base.clone(), add=True)
        torch.testing.assert_close(added, (base.double() + y64).float(), **TOL)

    @pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
    def test_gradient_kernels_match_autograd(self, case: tuple) -> None:
        T, H, D, R, N, layout = case
        seg, ids = _layout(T, layout)
        p = _problem(T, H, D, R, N, seed=T + 1)
        dv = torch.randn(T, R)
        _, (dx64, dA64) = _grads64(lambda x, A: lora.lora_shrink(x, A, seg, ids), p["x"], p["A"], dy=dv)
        v = lora.lora_shrink(p["x"], p["A"], seg, ids)
        _, (dv64, dB64) = _grads64(
            lambda v_, B: lora.lora_expand(v_, B, seg, ids, p["scale"].double()), v, p["B"], dy=p["dy"]
        )
        dx = st.sgmv_shrink_grad_x(dv, p["A"], seg, ids, out=_nan(T, H))
        dA = st.sgmv_shrink_grad_a(dv, p["x"], seg, ids, N, out=_nan(N, R, H))
        dv_k = st.sgmv_expand_grad_v(p["dy"], p["B"], seg, ids, p["scale"], out=_nan(T, R))
        dB = st.sgmv_expand_grad_b(p["dy"], v, seg, ids, p["scale"], N, out=_nan(N, D, R))
        # slots without tokens get zeros from the kernels and from autograd alike (A[w] indexing)
        for got, want in [(dx, dx64), (dA, dA64), (dv_k, dv64), (dB, dB64)]:
            torch.testing.assert_close(got, want.float(), **TOL)

    @pytest.mark.parametrize("case", [CASES["random"], CASES["unused-slot"]], ids=["random", "unused-slot"])
    def test_autograd_function_matches_reference(self, case: tuple) -> None:
        T, H, D, R, N, layout = case
        seg, ids = _layout(T, layout)
        p = _problem(T, H, D, R, N, seed=T + 2)
        scale64 = p["scale"].double()
        y64, grads64 = _grads64(
            lambda x, A, B: lora.lora_delta(x, A, B, scale64, seg, ids), p["x"], p["A"], p["B"], dy=p["dy"]
        )
        x = p["x"].T.contiguous().T.requires_grad_()  # column-major view: the kernels take any strides
        A, B = p["A"].clone().requires_grad_(), p["B"].clone().requires_grad_()
        y = st.lora_delta_triton(x, A, B, p["scale"], seg, ids)
        y.backward(p["dy"])
        torch.testing.assert_close(y.detach(), y64.float(), **TOL)
        for got, want in zip([x.grad, A.grad, B.grad], grads64, strict=True):
            torch.testing.assert_close(got, want.float(), **TOL)

    def test_backward_takes_a_broadcast_gradient(self) -> None:
        T, H, D, R, N = 24, 40, 40, 8, 2
        seg, ids = torch.tensor([0, 10, 10, 24]), torch.tensor([1, 0, 1])
        p = _problem(T, H, D, R, N, seed=5)

        def delta64(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
            return lora.lora_delta(x, A, B, p["scale"].double(), seg, ids)

        _, grads64 = _grads64(delta64, p["x"], p["A"], p["B"], dy=torch.ones(T, D))
        leaves = [p[k].clone().requires_grad_() for k in ("x", "A", "B")]
        st.lora_delta_triton(*leaves, p["scale"], seg, ids).sum().backward()  # dy has stride (0, 0)
        for leaf, want in zip(leaves, grads64, strict=True):
            torch.testing.assert_close(leaf.grad, want.float(), **TOL)

    def test_gradient_of_b_alone(self) -> None:
        T, H, D, R, N = 16, 40, 40, 8, 2
        seg, ids = torch.tensor([0, 9, 16]), torch.tensor([1, 0])
        p = _problem(T, H, D, R, N, seed=6)
        B = p["B"].clone().requires_grad_()
        st.lora_delta_triton(p["x"], p["A"], B, p["scale"], seg, ids).backward(p["dy"])

        def delta64(B: torch.Tensor) -> torch.Tensor:
            return lora.lora_delta(p["x"].double(), p["A"].double(), B, p["scale"].double(), seg, ids)

        _, (dB64,) = _grads64(delta64, p["B"], dy=p["dy"])
        torch.testing.assert_close(B.grad, dB64.float(), **TOL)

    def test_a_segment_gives_the_same_bits_alone_and_in_a_batch(self) -> None:
        T, H, D, R, N = 60, 72, 40, 12, 3
        p = _problem(T, H, D, R, N, seed=9)
        batch = st.lora_delta_triton(
            p["x"], p["A"], p["B"], p["scale"], torch.tensor([0, 17, 17, 45, 60]), torch.tensor([2, 0, 1, 2])
        )
        alone = st.lora_delta_triton(
            p["x"][17:45], p["A"], p["B"], p["scale"], torch.tensor([0, 28]), torch.tensor([1])
        )
        assert torch.equal(batch[17:45], alone)

    def test_fp16_inputs_match_reference(self) -> None:
        T, H, D, R, N = 48, 72, 40, 12, 3
        seg, ids = _layout(T, (5, 3, 7))
        p = _problem(T, H, D, R, N, seed=7, dtype=torch.float16)
        y = st.lora_delta_triton(p["x"], p["A"], p["B"], p["scale"], seg, ids)
        v64 = lora.lora_shrink(p["x"].double(), p["A"].double(), seg, ids).half().double()  # v is stored fp16
        y64 = lora.lora_expand(v64, p["B"].double(), seg, ids, p["scale"].double())
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.double(), y64, rtol=2e-3, atol=2e-3)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_bgmv_matches_reference_and_skips_unadapted_rows(self, dtype: torch.dtype) -> None:
        T, H, D, R, N = 21, 72, 40, 12, 4
        p = _problem(T, H, D, R, N, seed=8, dtype=dtype)
        idx = torch.randint(-1, N, (T,), generator=torch.Generator().manual_seed(8))
        idx[[0, 7]] = -1
        none = idx < 0
        per_token = torch.arange(T + 1), idx.clamp(min=0)  # one segment per token
        v64 = lora.lora_shrink(p["x"].double(), p["A"].double(), *per_token).masked_fill(none[:, None], 0.0)
        v = st.bgmv_shrink(p["x"], p["A"], idx, out=_nan(T, R).to(dtype))
        tol = TOL if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(v.double(), v64, **tol)
        v = v64.to(dtype)
        y64 = lora.lora_expand(v.double(), p["B"].double(), *per_token, p["scale"].double())
        y64 = y64.masked_fill(none[:, None], 0.0)
        torch.testing.assert_close(st.bgmv_expand(v, p["B"], idx, p["scale"]).double(), y64, **tol)
        set_out = st.bgmv_expand(v, p["B"], idx, p["scale"], _nan(T, D).to(dtype), add=False)
        torch.testing.assert_close(set_out.double(), y64, **tol)
        base = torch.randn(T, D).to(dtype)
        added = st.bgmv_expand(v, p["B"], idx, p["scale"], base.clone(), add=True)
        assert torch.equal(added[none], base[none])
        torch.testing.assert_close(added.double(), base.double() + y64, **tol)


class TestSgmvBatch:
    """``SgmvBatch`` (what a GPU pool runs; ``lora_batch(sgmv=True)``) against ``LoraBatch``'s per-segment torch
    path."""

    def test_mixed_ranks_and_missing_targets_match_the_torch_path(self) -> None:
        from lathe.models.config import ModelConfig
        from lathe.models.lora import LoraSpec, LoraWeights
        from lathe.models.lora_batch import lora_batch

        cfg = ModelConfig(arch="llama", vocab_size=40, hidden_size=24, intermediate_size=40, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=12, rms_norm_eps=1e-6, rope_theta=1e4,
                          max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
                          qk_norm=False, eos_token_ids=(0,))
        adapters = [LoraWeights.init(cfg, LoraSpec(rank=r, train_mlp=mlp), seed=r) for r, mlp in
                    ((4, True), (7, False), (2, True))]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for w in adapters:
                for b in w.b.values():
                    b.copy_(torch.randn(b.shape, generator=gen))
        seg, ids = [0, 5, 5, 13, 20], [2, 0, 1, 0]  # an empty segment, a slot used twice
        x = torch.randn(20, cfg.intermediate_size, generator=gen, requires_grad=True)
        key = (0, "down_proj")  # adapter 1 has no MLP targets
        outs = []
        for sgmv in (False, True):
            batch = lora_batch(seg, ids, adapters, invariant=False, sgmv=sgmv)
            y = batch.delta(key, x)
            y.backward(torch.ones_like(y))
            outs.append((y.detach(), x.grad.clone(), [w.a[key].grad.clone() for w in adapters if key in w.a]))
            x.grad = None
            for w in adapters:
                for p in w.parameters():
                    p.grad = None
        (y0, dx0, da0), (y1, dx1, da1) = outs
        torch.testing.assert_close(y1, y0, **TOL)
        torch.testing.assert_close(dx1, dx0, **TOL)
        for g1, g0 in zip(da1, da0, strict=True):
            torch.testing.assert_close(g1, g0, **TOL)
