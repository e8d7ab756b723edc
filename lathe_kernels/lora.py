"""Segmented LoRA ops (SGMV semantics), torch reference.

These are the oracle for every faster version (``lathe.kernels.sgmv_triton``) and the CPU path.
Tokens of a packed batch are sorted by adapter; a segment is a run of rows that share one adapter.

    x:     [T, H]      packed tokens, sorted so that each segment is contiguous
    seg:   [S+1] int64 segment starts, seg[0] = 0, seg[S] = T, non-decreasing (empty segments allowed)
    ids:   [S]   int64 adapter slot of each segment, into the stacked weights
    A:     [N, R, H]   stacked LoRA A matrices, rank-padded with zero rows
    B:     [N, O, R]   stacked LoRA B matrices, rank-padded with zero columns
    scale: [N]         alpha / rank of each slot

    lora_shrink:  v[seg[i]:seg[i+1]] = x[seg[i]:seg[i+1]] @ A[ids[i]].T                  -> v: [T, R]
    lora_expand:  y[seg[i]:seg[i+1]] = v[seg[i]:seg[i+1]] @ B[ids[i]].T * scale[ids[i]]  -> y: [T, O]
    lora_delta:   lora_expand(lora_shrink(x, A, seg, ids), B, seg, ids, scale)

Rows not covered by any segment do not exist (segments tile [0, T)). The reference is differentiable
with respect to x, A and B through torch autograd.

BGMV (decode: one adapter slot per row instead of per segment):

    idx:   [T]   int64 adapter slot of each row; -1: no adapter (the row's correction is 0)

    bgmv_shrink:  v[t] = x[t] @ A[idx[t]].T                                               -> v: [T, R]
    bgmv_expand:  y[t] = v[t] @ B[idx[t]].T * scale[idx[t]]                               -> y: [T, O]
    lora_delta_bgmv: bgmv_expand(bgmv_shrink(x, A, idx), B, idx, scale)
"""

from __future__ import annotations

import torch


def _segments(seg: torch.Tensor, ids: torch.Tensor) -> list[tuple[int, int, int]]:
    starts = seg.tolist()
    return [(starts[i], starts[i + 1], int(w)) for i, w in enumerate(ids.tolist()) if starts[i + 1] > starts[i]]


def lora_shrink(x: torch.Tensor, A: torch.Tensor, seg: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """v[seg[i]:seg[i+1]] = x[seg[i]:seg[i+1]] @ A[ids[i]].T; x [T, H], A [N, R, H] -> v [T, R]."""
    parts = [x[s0:s1] @ A[w].T for s0, s1, w in _segments(seg, ids)]
    if not parts:
        return x.new_zeros(x.shape[0], A.shape[1])
    return torch.cat(parts, dim=0)


def lora_expand(
    v: torch.Tensor, B: torch.Tensor, seg: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """y[seg[i]:seg[i+1]] = v[seg[i]:seg[i+1]] @ B[ids[i]].T * scale[ids[i]]; v [T, R], B [N, O, R] -> [T, O]."""
    parts = [(v[s0:s1] @ B[w].T) * scale[w] for s0, s1, w in _segments(seg, ids)]
    if not parts:
        return v.new_zeros(v.shape[0], B.shape[1])
    return torch.cat(parts, dim=0)


def lora_delta(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: torch.Tensor,
    seg: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The LoRA correction of a packed batch: lora_expand(lora_shrink(x, A, seg, ids), B, seg, ids, scale)."""
    return lora_expand(lora_shrink(x, A, seg, ids), B, seg, ids, scale)


def _gathered(w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w[idx[t]] for every row ([T, *w.shape[1:]], slot 0 standing in for -1) and the rows' mask [T, 1]."""
    if idx.dim() != 1 or idx.dtype.is_floating_point:
        raise ValueError(f"idx must be a 1-d integer tensor, got {idx.dtype} {tuple(idx.shape)}")
    # reading idx's largest value syncs with the device, which a CUDA graph capture does not allow
    if idx.numel() and not (idx.is_cuda and torch.cuda.is_current_stream_capturing()) and int(idx.max()) >= w.shape[0]:
        raise ValueError(f"idx holds slot {int(idx.max())}, but only {w.shape[0]} slots are stacked")
    return w[idx.clamp(min=0)], (idx >= 0)[:, None]


def bgmv_shrink(x: torch.Tensor, A: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """v[t] = x[t] @ A[idx[t]].T (0 where idx[t] < 0); x [T, H], A [N, R, H], idx [T] -> v [T, R]."""
    a, used = _gathered(A, idx)
    return torch.bmm(a, x[:, :, None])[:, :, 0] * used


def bgmv_expand(v: torch.Tensor, B: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y[t] = v[t] @ B[idx[t]].T * scale[idx[t]] (0 where idx[t] < 0); v [T, R], B [N, O, R] -> y [T, O]."""
    b, used = _gathered(B, idx)
    return torch.bmm(b, v[:, :, None])[:, :, 0] * (scale[idx.clamp(min=0)][:, None] * used)


def lora_delta_bgmv(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
                    idx: torch.Tensor) -> torch.Tensor:
    """The LoRA correction with one adapter slot per row: bgmv_expand(bgmv_shrink(x, A, idx), B, idx, scale)."""
    return bgmv_expand(bgmv_shrink(x, A, idx), B, idx, scale)
