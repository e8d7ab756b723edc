"""The Triton kernels behind ``lathe.kernels.sgmv_triton`` and their launchers: three products, the tile
choice, the grid and the argument checks. The ops and their meanings are ``sgmv_triton``'s.

    sgmm       out[seg[i]:seg[i+1]] (+)= x[seg[i]:seg[i+1]] @ w[ids[i]].T (* scale[ids[i]])
    seg_outer  g[n] = sum over the segments of slot n of p_seg.T @ q_seg (* alpha[n])
    bgmm       out[t] (+)= x[t] @ w[idx[t]].T (* scale[idx[t]]), one slot per row (-1: none)

Every kernel reads inputs in their own dtype (fp32, bf16 or fp16; x, A and B share one), accumulates in
fp32 and writes the output dtype; any strides are accepted (transposed views, broadcast gradients).
fp32 dots use IEEE precision (no TF32) so that fp32 results match the reference.

Triton is imported on the first kernel call, never at import time. No kernel uses atomics, so results are
bitwise reproducible run to run. Tile shapes follow the widths (H, O, R) only, never the batch layout, so
the bits of a token's v, y, dv and dx do not depend on which other segments share the batch; dA[n] and dB[n]
sum the segments of slot n in order, BLOCK_T tokens at a time.

The segmented launches need the longest segment length to size their grid; callers that know it (the
packer does) pass ``max_len``, otherwise it is read from ``seg`` with one device sync.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

_BLOCK_T = 32  # tokens per program (and per reduction step of the weight gradients); fixed, see above
_BLOCK_MAX = 128  # cap on the output-column and reduction tiles
_TILE_MAX = 8192  # cap on BLOCK_M * BLOCK_K: fp32 operand tiles stay under ~100 KB of shared memory


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


def check_operands(x: torch.Tensor, w: torch.Tensor, x_name: str, w_name: str, k_dim: int) -> None:
    """x [T, K] against stacked matrices w [N, *, *] whose dim ``k_dim`` is K, in x's dtype."""
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


def sgmm(
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


def seg_outer(
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


def bgmm(
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
