"""Triton SGMV/BGMV LoRA ops: the GPU path of the ops in ``lathe.kernels.lora``.

Owns the ops, their autograd and ``triton_available``; the kernels and their launches are
``lathe.kernels.sgmm_triton``'s, and the torch reference in ``lathe.kernels.lora`` owns the meaning.
Shapes follow that module:

    x:     [T, H]      packed tokens, sorted so that each segment is contiguous
    seg:   [S+1] int   segment starts, seg[0] = 0, seg[S] = T, non-decreasing (empty segments allowed)
    ids:   [S]   int   adapter slot of each segment (a slot may own several segments)
    idx:   [T]   int   adapter slot of each token (BGMV, decode); -1 means "no adapter"
    A:     [N, R, H]   stacked LoRA A matrices;  B: [N, O, R] stacked LoRA B matrices;  scale: [N]

Forward:  v = sgmv_shrink(x, A, seg, ids);  y = sgmv_expand(v, B, seg, ids, scale)
Backward: dv = sgmv_expand_grad_v(dy, B, ...);  dB = sgmv_expand_grad_b(dy, v, ...)
          dx = sgmv_shrink_grad_x(dv, A, ...);   dA = sgmv_shrink_grad_a(dv, x, ...)
``SgmvLoraFunction`` / ``lora_delta_triton`` chain them under autograd.

Results are bitwise reproducible and a token's bits do not depend on its batch neighbours (the kernels'
module says how). Triton is imported on the first kernel call, never at import time: this module imports
on a machine with neither a GPU nor ``TRITON_INTERPRET=1``, where ``triton_available()`` says False.
"""

from __future__ import annotations

from typing import Any

import torch

from lathe.kernels.sgmm_triton import bgmm, check_operands, max_segment_len, seg_outer, sgmm


def triton_available() -> bool:
    """True when the kernels can run here: Triton imports and has a GPU driver or runs interpreted."""
    try:
        import triton
    except ImportError:
        return False
    if triton.knobs.runtime.interpret:
        return True
    try:
        triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # "0 active drivers": no GPU
        return False
    return True


def sgmv_shrink(
    x: torch.Tensor,
    A: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """SGMV shrink: project each segment down to the LoRA rank with its own A.

        x: [T, H], A: [N, R, H], seg: [S+1], ids: [S]
        v[seg[i]:seg[i+1]] = x[seg[i]:seg[i+1]] @ A[ids[i]].T      -> v: [T, R] (written into out if given)
    """
    check_operands(x, A, "x", "A", 2)
    return sgmm(x, A, seg, ids, None, out, False, max_len)


def sgmv_expand(
    v: torch.Tensor,
    B: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    add: bool = True,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """SGMV expand: project each segment back up with its own B, scaled.

        v: [T, R], B: [N, O, R], scale: [N], seg: [S+1], ids: [S]
        y[seg[i]:seg[i+1]] = v[seg[i]:seg[i+1]] @ B[ids[i]].T * scale[ids[i]]
        out is None: return y [T, O];  add: out += y (the base output);  not add: out[:] = y
    """
    check_operands(v, B, "v", "B", 2)
    return sgmm(v, B, seg, ids, scale, out, add, max_len)


def sgmv_expand_grad_v(
    dy: torch.Tensor,
    B: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Gradient of sgmv_expand with respect to v.

        dy: [T, O], B: [N, O, R], scale: [N]
        dv[seg[i]:seg[i+1]] = dy[seg[i]:seg[i+1]] @ B[ids[i]] * scale[ids[i]]   -> dv: [T, R]
    """
    check_operands(dy, B, "dy", "B", 1)
    return sgmm(dy, B.transpose(1, 2), seg, ids, scale, out, False, max_len)


def sgmv_expand_grad_b(
    dy: torch.Tensor,
    v: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor,
    num_slots: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of sgmv_expand with respect to B, summed over every segment of a slot.

        dy: [T, O], v: [T, R], scale: [N]
        dB[n] = sum over i with ids[i] == n of (scale[n] * dy[seg[i]:seg[i+1]]).T @ v[seg[i]:seg[i+1]]
                                                            -> dB: [N, O, R] (zeros for slots without tokens)
    """
    return seg_outer(dy, v, seg, ids, scale, out, num_slots)


def sgmv_shrink_grad_x(
    dv: torch.Tensor,
    A: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Gradient of sgmv_shrink with respect to x (an expand with A transposed, unscaled).

        dv: [T, R], A: [N, R, H]
        dx[seg[i]:seg[i+1]] = dv[seg[i]:seg[i+1]] @ A[ids[i]]                    -> dx: [T, H]
    """
    check_operands(dv, A, "dv", "A", 1)
    return sgmm(dv, A.transpose(1, 2), seg, ids, None, out, False, max_len)


def sgmv_shrink_grad_a(
    dv: torch.Tensor,
    x: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    num_slots: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of sgmv_shrink with respect to A, summed over every segment of a slot.

        dv: [T, R], x: [T, H]
        dA[n] = sum over i with ids[i] == n of dv[seg[i]:seg[i+1]].T @ x[seg[i]:seg[i+1]]
                                                            -> dA: [N, R, H] (zeros for slots without tokens)
    """
    return seg_outer(dv, x, seg, ids, None, out, num_slots)


def bgmv_shrink(
    x: torch.Tensor, A: torch.Tensor, idx: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """BGMV shrink (decode): one adapter per token.

        x: [T, H], A: [N, R, H], idx: [T]
        v[t] = x[t] @ A[idx[t]].T if idx[t] >= 0 else 0                       -> v: [T, R]
    """
    check_operands(x, A, "x", "A", 2)
    return bgmm(x, A, idx, None, out, False)


def bgmv_expand(
    v: torch.Tensor,
    B: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    add: bool = True,
) -> torch.Tensor:
    """BGMV expand (decode): one adapter per token.

        v: [T, R], B: [N, O, R], scale: [N], idx: [T]
        y[t] = v[t] @ B[idx[t]].T * scale[idx[t]] if idx[t] >= 0 else 0
        out is None: return y [T, O];  add: out[t] += y[t] (rows with idx[t] < 0 kept);  not add: out[:] = y
    """
    check_operands(v, B, "v", "B", 2)
    return bgmm(v, B, idx, scale, out, add)


class SgmvLoraFunction(torch.autograd.Function):
    """y = lora_delta(x, A, B, scale, seg, ids) on the SGMV kernels, differentiable in x, A and B.

        x: [T, H], A: [N, R, H], B: [N, O, R], scale: [N], seg: [S+1], ids: [S] -> y: [T, O]
        forward:  v = x_seg @ A[n].T;  y = v_seg @ B[n].T * scale[n]            (v saved, [T, R])
        backward: dv = dy_seg @ B[n] * scale[n];  dx = dv_seg @ A[n]
                  dA[n] = sum_seg dv_seg.T @ x_seg;  dB[n] = sum_seg (scale[n] * dy_seg).T @ v_seg
    scale, seg and ids are constants (no gradient).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        scale: torch.Tensor,
        seg: torch.Tensor,
        ids: torch.Tensor,
        max_len: int | None = None,
    ) -> torch.Tensor:
        if max_len is None:
            max_len = max_segment_len(seg)
        v = sgmv_shrink(x, A, seg, ids, max_len=max_len)
        y = sgmv_expand(v, B, seg, ids, scale, max_len=max_len)
        ctx.save_for_backward(x, A, B, scale, seg, ids, v)
        ctx.max_len = max_len
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, A, B, scale, seg, ids, v = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        dx = dA = dB = None
        if need_x or need_a:
            dv = sgmv_expand_grad_v(dy, B, seg, ids, scale, max_len=ctx.max_len)
            if need_x:
                dx = sgmv_shrink_grad_x(dv, A, seg, ids, max_len=ctx.max_len)
            if need_a:
                dA = sgmv_shrink_grad_a(dv, x, seg, ids, A.shape[0])
        if need_b:
            dB = sgmv_expand_grad_b(dy, v, seg, ids, scale, B.shape[0])
        return dx, dA, dB, None, None, None, None


def lora_delta_triton(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    max_len: int | None = None,
) -> torch.Tensor:
    """``lathe.kernels.lora.lora_delta`` on the Triton kernels, with gradients for x, A and B.

        y[seg[i]:seg[i+1]] = x[seg[i]:seg[i+1]] @ A[ids[i]].T @ B[ids[i]].T * scale[ids[i]]  -> y: [T, O]
    """
    return SgmvLoraFunction.apply(x, A, B, scale, seg, ids, max_len)
