"""Triton SGMV/BGMV LoRA kernels: the GPU path of the ops in ``lathe.kernels.lora``.

Owns the kernels and their launchers; the torch reference in ``lathe.kernels.lora`` owns the meaning.
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

Every kernel reads inputs in their own dtype (fp32, bf16 or fp16; x, A and B share one), accumulates in
fp32 and writes the output dtype; any strides are accepted (transposed views, broadcast gradients).
fp32 dots use IEEE precision (no TF32) so that fp32 results match the reference.

Triton is imported on the first kernel call, never at import time: this module imports on a machine
with neither a GPU nor ``TRITON_INTERPRET=1``, where ``triton_available()`` says False. No kernel uses
atomics, so results are bitwise reproducible run to run. Tile shapes follow the widths (H, O, R) only,
never the batch layout, so the bits of a token's v, y, dv and dx do not depend on which other
segments share the batch; dA[n] and dB[n] sum the segments of slot n in order, BLOCK_T tokens at a time.

The segmented launches need the longest segment length to size their grid; callers that know it (the
packer does) pass ``max_len``, otherwise it is read from ``seg`` with one device sync.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

_BLOCK_T = 32  # tokens per program (and per reduction step of the weight gradients); fixed, see above
_BLOCK_MAX = 128  # cap on the output-column and reduction tiles
_TILE_MAX = 8192  # cap on BLOCK_M * BLOCK_K: fp32 operand tiles stay under ~100 KB of shared memory


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


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import Triton and define the kernels (once; ``TRITON_INTERPRET`` is read here by Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def sgmm(
        x, w, scale, out, seg, ids,
        M, K,
        stride_xt, stride_xk, stride_wn, stride_wm, stride_wk, stride_ot, stride_om,
        HAS_SCALE: tl.constexpr, ADD: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[seg[i]:seg[i+1]] (+)= x[seg[i]:seg[i+1]] @ w[ids[i]].T (* scale[ids[i]]).

        x [T, K], w [N, M, K], out [T, M]. Program (i, j, m) owns rows seg[i] + j*BLOCK_T + [0, BLOCK_T)
        of segment i and columns m*BLOCK_M + [0, BLOCK_M).
        """
        i = tl.program_id(0)
        t0 = tl.load(seg + i) + tl.program_id(1) * BLOCK_T
        t1 = tl.load(seg + i + 1)
        if t0 >= t1:
            return
        n = tl.load(ids + i)
        rt = t0 + tl.arange(0, BLOCK_T)
        rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        t_ok = rt < t1
        m_ok = rm < M
        x_ptr = x + rt[:, None] * stride_xt + rk[None, :] * stride_xk
        w_ptr = w + n * stride_wn + rk[:, None] * stride_wk + rm[None, :] * stride_wm  # w[n].T tile
        acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            x_tile = tl.load(x_ptr, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w_tile = tl.load(w_ptr, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = tl.dot(x_tile, w_tile, acc, input_precision=PRECISION)
            x_ptr += BLOCK_K * stride_xk
            w_ptr += BLOCK_K * stride_wk
        if HAS_SCALE:
            acc *= tl.load(scale + n).to(tl.float32)
        out_ptr = out + rt[:, None] * stride_ot + rm[None, :] * stride_om
        mask = t_ok[:, None] & m_ok[None, :]
        if ADD:
            acc += tl.load(out_ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def seg_outer(
        p, q, alpha, g, seg, ids,
        S, M, K,
        stride_pt, stride_pm, stride_qt, stride_qk, stride_gn, stride_gm, stride_gk,
        HAS_ALPHA: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """g[n] = sum over i with ids[i] == n of p[seg[i]:seg[i+1]].T @ q[seg[i]:seg[i+1]] (* alpha[n]).

        p [T, M], q [T, K], g [N, M, K]. Program (n, m, k) owns the [BLOCK_M, BLOCK_K] tile (m, k) of g[n]
        and walks the segments of slot n in order, so a slot without segments gets zeros.
        """
        n = tl.program_id(0)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        rt = tl.arange(0, BLOCK_T)
        m_ok = rm < M
        k_ok = rk < K
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for i in range(0, S):
            if tl.load(ids + i) == n:
                t1 = tl.load(seg + i + 1)
                for t0 in range(tl.load(seg + i), t1, BLOCK_T):
                    t_ok = rt < t1 - t0
                    p_ptr = p + (t0 + rt)[None, :] * stride_pt + rm[:, None] * stride_pm  # p.T tile
                    q_ptr = q + (t0 + rt)[:, None] * stride_qt + rk[None, :] * stride_qk
                    p_tile = tl.load(p_ptr, mask=m_ok[:, None] & t_ok[None, :], other=0.0)
                    q_tile = tl.load(q_ptr, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
                    acc = tl.dot(p_tile, q_tile, acc, input_precision=PRECISION)
        if HAS_ALPHA:
            acc *= tl.load(alpha + n).to(tl.float32)
        g_ptr = g + n * stride_gn + rm[:, None] * stride_gm + rk[None, :] * stride_gk
        tl.store(g_ptr, acc.to(g.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])

    @triton.jit
    def bgmm(
        x, w, scale, out, idx,
        M, K,
        stride_xt, stride_xk, stride_wn, stride_wm, stride_wk, stride_ot, stride_om,
        HAS_SCALE: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[t] (+)= x[t] @ w[idx[t]].T (* scale[idx[t]]); a row with idx[t] < 0 gets 0, or is kept if ADD.

        x [T, K], w [N, M, K], out [T, M]. Program (t, m) owns columns m*BLOCK_M + [0, BLOCK_M) of row t;
        a matrix-vector product on CUDA cores (one token, so no tensor-core tile to fill).
        """
        t = tl.program_id(0).to(tl.int64)
        n = tl.load(idx + t)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        out_ptr = out + t * stride_ot + rm * stride_om
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if n >= 0:
            for k0 in range(0, K, BLOCK_K):
                k_ok = rk < K - k0
                x_row = tl.load(x + t * stride_xt + (k0 + rk) * stride_xk, mask=k_ok, other=0.0)
                w_ptr = w + n * stride_wn + rm[:, None] * stride_wm + (k0 + rk)[None, :] * stride_wk
                w_tile = tl.load(w_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(w_tile.to(tl.float32) * x_row.to(tl.float32)[None, :], axis=1)
            if HAS_SCALE:
                acc *= tl.load(scale + n).to(tl.float32)
            if ADD:
                acc += tl.load(out_ptr, mask=m_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr, acc.to(out.dtype.element_ty), mask=m_ok)
        elif not ADD:
            tl.store(out_ptr, acc.to(out.dtype.element_ty), mask=m_ok)  # no adapter: zeros

    return SimpleNamespace(sgmm=sgmm, seg_outer=seg_outer, bgmm=bgmm)


def _block(n: int, cap: int = _BLOCK_MAX) -> int:
    """Power-of-two tile covering n, at least 16 (the smallest tl.dot side), at most cap."""
    return min(cap, max(16, 1 << max(0, n - 1).bit_length()))


def _tiles(M: int, K: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): the reduction tile first, then as many output columns as _TILE_MAX allows."""
    block_k = _block(K)
    return _block(M, min(_BLOCK_MAX, _TILE_MAX // block_k)), block_k


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is Triton's default; moot off fp32


def max_segment_len(seg: torch.Tensor) -> int:
    """max(seg[i+1] - seg[i]), 0 without segments: the grid size of the segmented launches (one sync)."""
    return int((seg[1:] - seg[:-1]).max()) if seg.numel() > 1 else 0


def _check_segments(seg: torch.Tensor, ids: torch.Tensor) -> None:
    if seg.dim() != 1 or ids.dim() != 1 or seg.numel() != ids.numel() + 1:
        raise ValueError(f"seg must be [S+1] and ids [S]; got seg {tuple(seg.shape)}, ids {tuple(ids.shape)}")
    if seg.dtype.is_floating_point or ids.dtype.is_floating_point:
        raise ValueError(f"seg and ids must be integer tensors; got {seg.dtype} and {ids.dtype}")


def _check_operands(x: torch.Tensor, w: torch.Tensor, x_name: str, w_name: str, k_dim: int) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[k_dim]:
        raise ValueError(f"{x_name} {tuple(x.shape)} does not fit {w_name} {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"{x_name} and {w_name} must share a dtype; got {x.dtype} and {w.dtype}")


def _output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return like.new_empty(shape)
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(out.shape)}")
    return out


def _sgmm(
    x: torch.Tensor,
    w: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor | None,
    add: bool,
    max_len: int | None,
) -> torch.Tensor:
    """out[seg[i]:seg[i+1]] (+)= x[seg[i]:seg[i+1]] @ w[ids[i]].T (* scale[ids[i]]); x [T, K], w [N, M, K]."""
    T = x.shape[0]
    M, K = w.shape[1], w.shape[2]
    _check_segments(seg, ids)
    add = add and out is not None
    out = _output(out, (T, M), x, "out")
    if max_len is None:
        max_len = max_segment_len(seg)
    if ids.numel() == 0 or max_len == 0 or M == 0:
        return out
    block_m, block_k = _tiles(M, K)
    grid = (ids.numel(), _cdiv(max_len, _BLOCK_T), _cdiv(M, block_m))
    _kernels().sgmm[grid](
        x, w, w if scale is None else scale, out, seg.contiguous(), ids.contiguous(),
        M, K,
        *x.stride(), *w.stride(), *out.stride(),
        HAS_SCALE=scale is not None, ADD=add, PRECISION=_precision(x.dtype),
        BLOCK_T=_BLOCK_T, BLOCK_M=block_m, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def _seg_outer(
    p: torch.Tensor,
    q: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
    alpha: torch.Tensor | None,
    out: torch.Tensor | None,
    num_slots: int,
) -> torch.Tensor:
    """g[n] = sum over the segments of slot n of p_seg.T @ q_seg (* alpha[n]); p [T, M], q [T, K]."""
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != q.shape[0]:
        raise ValueError(f"operands must be [T, *] with one T; got {tuple(p.shape)}, {tuple(q.shape)}")
    if p.dtype != q.dtype:
        raise ValueError(f"operands must share a dtype; got {p.dtype} and {q.dtype}")
    _check_segments(seg, ids)
    M, K = p.shape[1], q.shape[1]
    g = _output(out, (num_slots, M, K), p, "out")
    if g.numel() == 0:
        return g
    block_m, block_k = _tiles(M, K)
    grid = (num_slots, _cdiv(M, block_m), _cdiv(K, block_k))
    _kernels().seg_outer[grid](
        p, q, q if alpha is None else alpha, g, seg.contiguous(), ids.contiguous(),
        ids.numel(), M, K,
        *p.stride(), *q.stride(), *g.stride(),
        HAS_ALPHA=alpha is not None, PRECISION=_precision(p.dtype),
        BLOCK_T=_BLOCK_T, BLOCK_M=block_m, BLOCK_K=block_k,
    )  # fmt: skip
    return g


def _bgmm(
    x: torch.Tensor,
    w: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor | None,
    add: bool,
) -> torch.Tensor:
    """out[t] (+)= x[t] @ w[idx[t]].T (* scale[idx[t]]), rows with idx[t] < 0 zero or kept; w [N, M, K]."""
    T = x.shape[0]
    M, K = w.shape[1], w.shape[2]
    if idx.shape != (T,) or idx.dtype.is_floating_point:
        raise ValueError(f"idx must be an integer tensor of shape ({T},); got {idx.dtype} {tuple(idx.shape)}")
    add = add and out is not None
    out = _output(out, (T, M), x, "out")
    if T == 0 or M == 0:
        return out
    block_m, block_k = _tiles(M, K)
    _kernels().bgmm[(T, _cdiv(M, block_m))](
        x, w, w if scale is None else scale, out, idx.contiguous(),
        M, K,
        *x.stride(), *w.stride(), *out.stride(),
        HAS_SCALE=scale is not None, ADD=add, BLOCK_M=block_m, BLOCK_K=block_k,
    )  # fmt: skip
    return out


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
    _check_operands(x, A, "x", "A", 2)
    return _sgmm(x, A, seg, ids, None, out, False, max_len)


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
    _check_operands(v, B, "v", "B", 2)
    return _sgmm(v, B, seg, ids, scale, out, add, max_len)


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
    _check_operands(dy, B, "dy", "B", 1)
    return _sgmm(dy, B.transpose(1, 2), seg, ids, scale, out, False, max_len)


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
    return _seg_outer(dy, v, seg, ids, scale, out, num_slots)


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
    _check_operands(dv, A, "dv", "A", 1)
    return _sgmm(dv, A.transpose(1, 2), seg, ids, None, out, False, max_len)


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
    return _seg_outer(dv, x, seg, ids, None, out, num_slots)


def bgmv_shrink(
    x: torch.Tensor, A: torch.Tensor, idx: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """BGMV shrink (decode): one adapter per token.

        x: [T, H], A: [N, R, H], idx: [T]
        v[t] = x[t] @ A[idx[t]].T if idx[t] >= 0 else 0                       -> v: [T, R]
    """
    _check_operands(x, A, "x", "A", 2)
    return _bgmm(x, A, idx, None, out, False)


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
    _check_operands(v, B, "v", "B", 2)
    return _bgmm(v, B, idx, scale, out, add)


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
