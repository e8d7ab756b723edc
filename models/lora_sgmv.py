"""``SgmvBatch``: the LoRA backend of GPU pools, every segment of a packed batch through one Triton SGMV shrink and
one expand (``lathe.kernels.sgmv_triton``).

Adapters are stacked with ranks zero-padded to the largest; an adapter without a target gets zero matrices.
Padding changes the reduction length, so these bits are not ``LoraBatch``'s: a pool runs one backend for its
trainer and sampler alike (``lora_batch.lora_batch``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from lathe.kernels import tiling
from lathe.models.lora import REFERENCE_TILES, Key, LoraWeights, clip_rows, parameters_of, row_segments, take_rows


@dataclass(slots=True)
class SgmvBatch:
    """Rows ``seg[i]:seg[i+1]`` of every activation belong to adapter ``adapters[ids[i]]``."""

    seg: list[int]
    ids: list[int]
    adapters: list[LoraWeights]
    _segments: list[tuple[int, int, LoraWeights]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._segments = row_segments(self.seg, self.ids, self.adapters)

    def rows(self, r0: int, r1: int) -> SgmvBatch:
        return SgmvBatch(clip_rows(self.seg, r0, r1), list(self.ids), self.adapters)

    def take(self, rows: list[int]) -> SgmvBatch:
        return SgmvBatch(take_rows(self.seg, rows), list(self.ids), self.adapters)

    def parameters_of(self, key: Key) -> list[torch.Tensor]:
        return parameters_of(self._segments, key)

    def chained(self, key: Key, x: torch.Tensor,
                ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> None:
        """None: the kernels never run a segment through ``lathe.kernels.chain`` (``LoraDeltas.chained``)."""
        return None

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The correction ``[T, O]`` of target ``key`` (None where no adapter with rows has it); ``ladders`` is
        the protocol's and unused: the kernels choose their own tiles."""
        from lathe.kernels.sgmv_triton import lora_delta_triton  # Triton only where a pool runs this backend

        holders = [w for _, _, w in self._segments if key in w.a]
        if not holders:
            return None
        out_features = holders[0].b[key].shape[0]
        rank = max(w.a[key].shape[0] for w in self.adapters if key in w.a)
        in_features = x.shape[1]

        def pad(t: torch.Tensor | None, shape: tuple[int, int], rows: bool) -> torch.Tensor:
            if t is None:
                return x.new_zeros(shape)
            t = t.to(device=x.device, dtype=x.dtype)
            extra = rank - (t.shape[0] if rows else t.shape[1])
            return torch.nn.functional.pad(t, (0, 0, 0, extra) if rows else (0, extra))

        a = torch.stack([pad(w.a.get(key), (rank, in_features), rows=True) for w in self.adapters])
        b = torch.stack([pad(w.b.get(key), (out_features, rank), rows=False) for w in self.adapters])
        scale = torch.tensor([w.spec.scale for w in self.adapters], device=x.device, dtype=torch.float32)
        seg = torch.tensor(self.seg, device=x.device)
        ids = torch.tensor(self.ids, device=x.device)
        max_len = max((s1 - s0 for s0, s1 in itertools.pairwise(self.seg)), default=0)  # known: no device sync
        return lora_delta_triton(x, a, b, scale, seg, ids, max_len)
