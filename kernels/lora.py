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
