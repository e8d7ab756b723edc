"""What a training pass keeps for backward, cut to what backward cannot cheaply rebuild.

    swiglu(gate, up) -> h                              (the Llama MLP's gate)
      gate, up: [..., I]
      h = silu(gate) * up                                                  -> h: [..., I]
      saves gate and up only; backward recomputes silu(gate)

    with recomputed(t, make): ...
      tensors autograd saves inside the block that are views of ``t``'s storage are not kept: backward
      calls ``make()`` (once, when a node first asks) and reads the same view of its result

The decoder opens a ``recomputed`` block after each RMSNorm, so that the linears after it keep no copy of its output
(and none inside a checkpointed layer, where checkpointing's own hooks must stay in charge).

Both change what is stored between forward and backward, never a bit of a result: the forward runs the ops
it ran before, and backward runs autograd's own formulas on recomputed values that are the saved ones bit for
bit (``make`` must be a deterministic function of tensors kept anyway, as an upcast or ``swiglu`` of its
saved inputs is). Measured on SmolLM2 (8 x 256 tokens, rank 32 on 7 targets): autograd kept ``silu(gate)``
and ``h`` beside ``gate`` and ``up`` (four [T, 1536] activations a layer), and a bf16 pass kept an fp32 copy of
every RMSNorm input; see bench/RESULTS.md for the peak-RSS figures.

Owns nothing beyond one backward: a ``recomputed`` block's rebuilt tensor lives until the last node that
saved a view of it has run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # noqa: ANN001
        gate, up = ctx.saved_tensors
        # autograd's formulas for silu(gate) * up: d silu = grad * up, d up = grad * silu(gate), d gate by
        # aten's silu_backward, so the bits are the ones the unfused ops gave
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (see the module docstring); under autograd it keeps ``gate`` and ``up`` only."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return F.silu(gate) * up


class _Rebuilt:
    """The one recomputation a ``recomputed`` block hands its saved views: ``make()`` run at most once."""

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self.make: Callable[[], torch.Tensor] | None = make
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            assert self.make is not None
            with torch.no_grad():
                self.value = self.make()
            self.make = None  # drop what it closed over as soon as it has run
        return self.value


def recomputed(t: torch.Tensor, make: Callable[[], torch.Tensor], *, enabled: bool = True
               ) -> contextlib.AbstractContextManager[object]:
    """See the module docstring. ``t`` must be alive through the block (its storage is how its views are told
    apart); it and ``make()``'s result are contiguous tensors of one dtype and shape. Without grad (decoding) or
    ``enabled`` the block is a shared no-op context. Not enabled inside activation checkpointing around a wide block:
    its hooks would replace checkpointing's there, and every other tensor saved in the block would be kept."""
    if not torch.is_grad_enabled() or not enabled:
        return _NOTHING
    if not t.is_contiguous():
        raise ValueError(f"recomputed: the tensor to rebuild must be contiguous (shape {tuple(t.shape)}, "
                         f"strides {t.stride()})")
    ptr, base, dtype, rebuilt = t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, _Rebuilt(make)

    def pack(s: torch.Tensor) -> object:
        if s.dtype == dtype and s.untyped_storage().data_ptr() == ptr:
            return rebuilt, s.shape, s.stride(), s.storage_offset()
        return s

    def unpack(saved: object) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        source, shape, stride, offset = saved
        return source.get().as_strided(shape, stride, offset - base)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


_NOTHING = contextlib.nullcontext()
