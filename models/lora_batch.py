"""``LoraBatch``: the LoRA backend of the invariant CPU path (trainer and sampler) and of the plain ops' reference.

Each segment of a packed batch (rows ``seg[i]:seg[i+1]``, adapter ``adapters[ids[i]]``) gets

    y[s0:s1] = ((x[s0:s1] @ A.T) * (alpha / rank)) @ B.T

either per segment (``delta_per_segment``: ``ops.linear`` on each segment alone, the reference) or grouped
(``lathe.kernels.lora_grouped``: every segment of one rank in one shrink and one expand on fixed tiles, with the
reference's bits). ``lora_batch`` picks this backend or ``lora_sgmv.SgmvBatch`` for a pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lathe.kernels import chain, ops, tiling
from lathe.kernels.chain import chain_lora, chain_lora_segments
from lathe.kernels.lora_grouped import TileLayout, lora_grouped, stacks
from lathe.models.lora import REFERENCE_TILES, Key, LoraWeights, clip_rows, parameters_of, row_segments, take_rows
from lathe.models.lora_sgmv import SgmvBatch


def lora_batch(seg: list[int], ids: list[int], adapters: list[LoraWeights], *, invariant: bool,
               sgmv: bool) -> LoraBatch | SgmvBatch:
    """The LoRA backend a pool runs for a packed batch: the Triton SGMV kernels where the pool enables them (GPU;
    the same for its trainer and sampler, whose bits then are the kernels'), else ``LoraBatch``."""
    return SgmvBatch(seg, ids, adapters) if sgmv else LoraBatch(seg, ids, adapters, invariant)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatched op when it is one already (a decode step runs this ~800 times)."""
    return t if t.dtype == dtype else t.to(dtype)


def _lone_tile(ladder: tiling.Ladder, rows: int, x: torch.Tensor, a: torch.Tensor) -> int:
    """``tiling.lone_height`` out of autograd (under it, ``ops.linear``'s differentiable products run); 0 in it."""
    if _autograd(x, a):
        return 0
    return tiling.lone_height(ladder, rows, x.device)


CHAIN_SEGMENT_ROWS = 32
"""Most rows of a frozen adapter's segment that run through Lathe's kernel (``_chained``): a decode step's share of a
batch; a prefill's longer segments keep the library's products."""


def _chained(ladder: tiling.Ladder, rows: int, x: torch.Tensor, w: LoraWeights, key: Key
             ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(block, A, B) where a segment of ``rows`` rows of ``w`` runs both products of its correction in one call of
    Lathe's fixed-order kernel (``chain.chain_lora``), with the bits ``ops.linear`` gives its rows on ``ladder``
    (which admitted the kernel's block for the rank): out of autograd, fp32, and either lone rows on the ladder
    (``tiling.lone_rows``) or a frozen adapter's segment of at most ``CHAIN_SEGMENT_ROWS`` rows, which reads the
    adapter's column-major copies (``LoraWeights.columns``: each weight streamed as rows, for several rows at a
    time). None otherwise."""
    a = w.a[key]
    if not ladder.chain or a.dtype != torch.float32 or x.device.type != "cpu" or _autograd(x, a):
        return None
    if w.frozen and rows <= CHAIN_SEGMENT_ROWS:
        return ladder.chain, *w.columns(key)
    if tiling.lone_rows(ladder, rows, x.device):
        return ladder.chain, a, w.b[key]
    return None


def _autograd(x: torch.Tensor, a: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or a.requires_grad)


@dataclass(slots=True)
class LoraBatch:
    """The adapter layout of a packed batch.

    Rows ``seg[i]:seg[i+1]`` of every activation belong to adapter ``adapters[ids[i]]``. The decoder
    calls ``delta(key, x)`` after each target module's base matmul. Each segment's rows are computed in
    tiles of their own (no rank padding, no dependence on which other adapters share the batch), with the
    same fixed-shape products as the base model, so a token's bits do not depend on its batch mates.
    """

    seg: list[int]
    ids: list[int]
    adapters: list[LoraWeights]
    invariant: bool = True
    _segments: list[tuple[int, int, LoraWeights]] = field(default_factory=list)
    _layouts: dict[tuple[tuple[int, int, int], ...], TileLayout] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._segments = row_segments(self.seg, self.ids, self.adapters)

    def rows(self, r0: int, r1: int) -> LoraBatch:
        """The same layout restricted to rows [r0, r1) (for chunked LM-head work)."""
        return LoraBatch(clip_rows(self.seg, r0, r1), list(self.ids), self.adapters, self.invariant)

    def take(self, rows: list[int]) -> LoraBatch:
        """The same layout over rows ``rows`` (ascending), renumbered from 0 (an expert's tokens)."""
        return LoraBatch(take_rows(self.seg, rows), list(self.ids), self.adapters, self.invariant)

    def parameters_of(self, key: Key) -> list[torch.Tensor]:
        return parameters_of(self._segments, key)

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The LoRA correction of target ``key`` for activations ``x [T, I]`` -> ``[T, O]`` or None.

        Computed in fp32 (fp64 for fp64 activations) whatever the base dtype: the precision policy keeps
        LoRA weights, their products and gradients in fp32 under a bf16 base; the caller rounds once.
        Invariant mode runs every segment of one rank through one grouped shrink and expand
        (``lathe.kernels.lora_grouped``), with the bits of ``delta_per_segment``; a batch of one segment out of
        autograd (a decode step of one adapter) runs ``delta_per_segment`` itself: the same products in fewer
        ops, over the ladder the pool admitted for its rank (``ladders``, by rank: the decoder's
        ``lora_ladders``), which has the reference tile's bits. So does a batch out of autograd whose grouped
        product could not stack its adapters' weights (``_per_segment``). A batch out of autograd whose every
        segment runs through Lathe's kernel (``_chained``: a sampler's decode step) runs them all in one call
        (``chain.chain_lora_segments``), each segment's rows with the bits it has alone.
        """
        holders = [w for _, _, w in self._segments if key in w.a]
        if not holders:
            return None
        chained = self.chained(key, x, ladders)
        if chained is not None:
            return chain_lora_segments(_as(x, torch.float32), chained, holders[0].b[key].shape[0])
        if not self.invariant or (not torch.is_grad_enabled() and self._per_segment(key, x, holders, ladders)):
            return self.delta_per_segment(key, x, ladders)
        out = None
        for rank in sorted({w.spec.rank for w in holders}):
            layout, members = self._layout(key, rank, x)
            part = lora_grouped(x, layout, [w.a[key] for w in members], [w.b[key] for w in members],
                                [w.spec.scale for w in members])
            out = part if out is None else out + part  # each part is zero outside its own rows
        return out

    def chained(self, key: Key, x: torch.Tensor,
                ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> list[chain.Segment] | None:
        """Target ``key``'s segments where ``delta`` runs every one through Lathe's kernel (invariant, out of
        autograd, each ``_chained``), for a caller that adds them to its base product in the same call
        (``chain.chain_linear``): [] where no segment has ``key``, None where ``delta`` runs otherwise."""
        if not self.invariant or torch.is_grad_enabled():
            return None
        return self._chained_segments(key, x, ladders)

    def _per_segment(self, key: Key, x: torch.Tensor, holders: list[LoraWeights],
                     ladders: Mapping[int, tiling.Ladder]) -> bool:
        """Whether ``key`` runs faster per segment, over its ranks' ladders, than grouped: one segment, or an expand
        the grouped product cannot stack (``lora_grouped.stacks``: the LM head's over several adapters), which it
        would run one segment at a time anyway, in one-thread products (measured on a 2-core EPYC, 4 adapters x 8
        decode rows at rank 32: 24 ms grouped, 7 ms per segment on the direct ladder)."""
        if len(self._segments) == 1:
            return True
        if any(not ladders.get(w.spec.rank, tiling.REFERENCE).direct for w in holders):  # no direct products
            return False
        for rank in {w.spec.rank for w in holders}:
            layout, members = self._layout(key, rank, x)
            expand = members[0].b[key]
            c0, c1 = tiling.col_blocks(rank, expand.shape[0], expand.element_size())[0]  # the expand's first block
            if not stacks(layout, expand[c0:c1]):
                return True
        return False

    def _chained_segments(self, key: Key, x: torch.Tensor, ladders: Mapping[int, tiling.Ladder]
                          ) -> list[chain.Segment] | None:
        """Every segment holding ``key`` as a ``chain.chain_lora_segments`` segment, if each runs through Lathe's
        kernel (``_chained``: a SmolLM2 layer's seven targets for 4 adapters x 8 decode rows at rank 32 in 1.0-1.1 ms
        instead of 2.8-3.2 grouped, AVX2 EPYC, ``bench/bench_decode_lora.py``); None if any does not."""
        segments: list[chain.Segment] = []
        for s0, s1, w in self._segments:
            if key not in w.a:
                continue
            chained = _chained(ladders.get(w.spec.rank, tiling.REFERENCE), s1 - s0, x, w, key)
            if chained is None:
                return None
            block, a, b = chained
            segments.append((s0, s1 - s0, a, b, w.spec.scale, block))
        return segments

    def _layout(self, key: Key, rank: int, x: torch.Tensor) -> tuple[TileLayout, list[LoraWeights]]:
        """The tile layout of the segments whose adapter has ``key`` at ``rank``, and those adapters by slot."""
        members: list[LoraWeights] = []
        spans: list[tuple[int, int, int]] = []
        for s0, s1, w in self._segments:
            if key in w.a and w.spec.rank == rank:
                slot = next((i for i, m in enumerate(members) if m is w), None)
                if slot is None:
                    slot, members = len(members), [*members, w]
                spans.append((s0, s1, slot))
        cache_key = tuple(spans)
        layout = self._layouts.get(cache_key)
        if layout is None:
            layout = self._layouts[cache_key] = TileLayout.build(x.shape[0], spans, tiling.ROW_TILE, x.device)
        return layout, members

    def delta_per_segment(self, key: Key, x: torch.Tensor,
                          ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The reference: each segment through its own ``ops.linear`` pair (the plain mode, and the oracle
        the self-check holds the grouped path to), over the reference tile or the ladder of its rank in
        ``ladders``."""
        holders = [w for _, _, w in self._segments if key in w.a]
        if not holders:
            return None
        out_features = holders[0].b[key].shape[0]
        wide = torch.promote_types(x.dtype, torch.float32)
        parts = []
        for s0, s1, w in self._segments:
            xs = _as(x if s1 - s0 == x.shape[0] else x[s0:s1], wide)
            if key not in w.a:
                parts.append(xs.new_zeros(s1 - s0, out_features))
                continue
            a, b, ladder = _as(w.a[key], wide), _as(w.b[key], wide), ladders.get(w.spec.rank, tiling.REFERENCE)
            chained = _chained(ladder, s1 - s0, xs, w, key)
            if chained is not None:  # one call for both products
                block, ca, cb = chained
                parts.append(chain_lora(xs, ca, cb, w.spec.scale, block))
                continue
            tile = _lone_tile(ladder, s1 - s0, x, a)
            if tile:  # both products in one zero-padded direct tile, as ``ops.linear`` runs each of them
                v = ops.direct_tile(F.pad(xs, (0, 0, 0, tile - (s1 - s0))), a.t())
                parts.append(ops.direct_tile(v * w.spec.scale, b.t())[:s1 - s0])
                continue
            v = ops.linear(xs, a, invariant=self.invariant, ladder=ladder)
            parts.append(ops.linear(v * w.spec.scale, b, invariant=self.invariant, ladder=ladder))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
