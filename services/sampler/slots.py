"""The sampler's adapter slot pool: adapters resident in stacked, rank-padded buffers, for BGMV decode.

    SlotPool(cfg, slots, rank_max, dtype, device, bgmv)   per LoRA target key of the base model (every
                                                     layer's attention and MLP modules, and the unembedding):
      a[key]: [slots, rank_max, in]   b[key]: [slots, out, rank_max]   scale: [slots]   on ``device``
      An adapter loaded into slot n fills a[key][n, :r] and b[key][n, :, :r]; the rest of the slot, and
      every key the adapter does not train, is zeros (a zero correction). ``load(key, weights, busy)``
      returns the adapter's slot, loading it into a free slot or the least recently used one that no
      running sequence uses (``busy``); host-to-device copies go through ``lathe.models.host``
      (pinned, non_blocking on CUDA). ``place(rows)`` does it for one step: the slot of every row's adapter,
      without evicting one the step needs, or None when the step's adapters do not fit at once.

    SlotBatch(pool, idx)                              one step's LoRA layout, built once per step
      idx: [T] int64 on the device: the slot of each packed row, -1 for the base model
      delta(key, x [T, in]) -> [T, out]: y[t] = x[t] @ a[key][idx[t]].T @ b[key][idx[t]].T * scale[idx[t]]
        through the pool's BGMV (``BGMV``: "triton", ``lathe.kernels.sgmv_triton.bgmv_*``, on CUDA; "torch",
        the reference ``lathe.kernels.lora.lora_delta_bgmv``, anywhere), computed in x's dtype; reads no
        host value (``idx`` may be a CUDA graph's static buffer)

Rank padding changes reduction lengths, so these bits are not the per-segment path's (``LoraBatch``): the
CPU invariant path, whose logprobs equal the trainer's bit for bit, keeps using that. Owned by the engine
(one pool per base model); only the scheduler thread touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping

import torch

from lathe.errors import ResourceExhausted
from lathe.kernels import tiling
from lathe.kernels.lora import lora_delta_bgmv
from lathe.kernels.sgmv_triton import bgmv_expand, bgmv_shrink
from lathe.models.config import ModelConfig
from lathe.models.host import to_device
from lathe.models.lora import REFERENCE_TILES, Key, LoraSpec, LoraWeights, module_shape


def _triton_bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 idx: torch.Tensor) -> torch.Tensor:
    return bgmv_expand(bgmv_shrink(x, a, idx), b, idx, scale, add=False)


def _torch_bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                idx: torch.Tensor) -> torch.Tensor:
    return lora_delta_bgmv(x, a, b, scale.to(x.dtype), idx)


BGMV: dict[str, Callable[..., torch.Tensor]] = {"triton": _triton_bgmv, "torch": _torch_bgmv}
"""BGMV implementations by name: ``f(x [T, in], a [N, R, in], b [N, out, R], scale [N] fp32, idx [T]) -> [T, out]``."""


class SlotPool:
    """``slots`` adapter slots of rank up to ``rank_max`` for one base model."""

    @torch.inference_mode()
    def __init__(self, cfg: ModelConfig, slots: int, rank_max: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", bgmv: str = "torch") -> None:
        if slots < 1 or rank_max < 1:
            raise ValueError(f"a slot pool needs slots >= 1 and rank_max >= 1, got {slots} and {rank_max}")
        if bgmv not in BGMV:
            raise ValueError(f"bgmv {bgmv!r} is not one of {sorted(BGMV)}")
        self.slots, self.rank_max, self.dtype, self.device = slots, rank_max, dtype, torch.device(device)
        self.bgmv = bgmv
        keys = LoraSpec(rank=1).keys(cfg)  # every target: attention, MLP and the unembedding
        self.a: dict[Key, torch.Tensor] = {}
        self.b: dict[Key, torch.Tensor] = {}
        for key in keys:
            fan_in, fan_out = module_shape(cfg, key[1])
            self.a[key] = torch.zeros(slots, rank_max, fan_in, dtype=dtype, device=self.device)
            self.b[key] = torch.zeros(slots, fan_out, rank_max, dtype=dtype, device=self.device)
        self.scale = torch.zeros(slots, dtype=torch.float32, device=self.device)
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # adapter key -> slot, least recently used first
        self.loads = 0

    def slot_of(self, key: Hashable) -> int | None:
        return self._lru.get(key)

    @torch.inference_mode()
    def load(self, key: Hashable, weights: LoraWeights, busy: set[int]) -> int:
        """The slot holding adapter ``key`` (``weights``), loading it if it is not resident. ``busy``: slots
        that running sequences use, never evicted."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return self._lru[key]
        rank = weights.spec.rank
        if rank > self.rank_max:
            raise ValueError(f"adapter {key!r} has rank {rank}; this sampler's adapter slots hold rank <= "
                             f"{self.rank_max}")
        unknown = sorted(set(weights.a) - set(self.a))
        if unknown:
            raise ValueError(f"adapter {key!r} trains {unknown[:3]}, which this base model has no slot for")
        slot = self._free_slot(busy)
        host = to_device({f"a{k}": t for k, t in weights.a.items()}
                         | {f"b{k}": t for k, t in weights.b.items()}, self.device)
        for k in self.a:
            self.a[k][slot].zero_()
            self.b[k][slot].zero_()
            if k in weights.a:
                self.a[k][slot, :rank] = host[f"a{k}"]
                self.b[k][slot, :, :rank] = host[f"b{k}"]
        self.scale[slot] = weights.spec.scale
        self._lru[key] = slot
        self.loads += 1
        return slot

    def place(self, rows: list[tuple[Hashable, LoraWeights] | None]) -> list[int] | None:
        """The slot of each row's adapter (``(key, weights)``; None: the base model, slot -1), loading the
        adapters that are not resident without evicting one another row needs. None (nothing loaded) when the
        distinct adapters outnumber the slots or one has a rank above ``rank_max``."""
        wanted = {key: w for key, w in (r for r in rows if r is not None)}
        if len(wanted) > self.slots or any(w.spec.rank > self.rank_max for w in wanted.values()):
            return None
        busy = {n for key, n in self._lru.items() if key in wanted}
        slot = {}
        for key, w in wanted.items():
            slot[key] = self.load(key, w, busy)
            busy.add(slot[key])
        return [-1 if r is None else slot[r[0]] for r in rows]

    def _free_slot(self, busy: set[int]) -> int:
        used = set(self._lru.values())
        free = [n for n in range(self.slots) if n not in used]
        if free:
            return free[0]
        for old, n in self._lru.items():
            if n not in busy:
                del self._lru[old]
                return n
        raise ResourceExhausted(f"all {self.slots} adapter slots are used by running sequences; retry later",
                                retry_after_s=1.0)


class SlotBatch:
    """The LoRA layout of one packed step over a ``SlotPool`` (a ``LoraDeltas`` backend, as ``LoraBatch`` is):
    ``idx [T]``, the slot of each row (-1: none)."""

    def __init__(self, pool: SlotPool, idx: torch.Tensor | list[int]) -> None:
        self.pool = pool
        self.idx = torch.as_tensor(idx, dtype=torch.long).to(pool.device)

    def rows(self, r0: int, r1: int) -> SlotBatch:
        """The same layout restricted to rows [r0, r1)."""
        return SlotBatch(self.pool, self.idx[r0:r1])

    def take(self, rows: list[int]) -> SlotBatch:
        """The same layout over rows ``rows`` (an expert's tokens)."""
        return SlotBatch(self.pool, self.idx[torch.tensor(rows, dtype=torch.long, device=self.idx.device)])

    def chained(self, key: Key, x: torch.Tensor,
                ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> None:
        """None: BGMV never runs a slot through ``lathe.kernels.chain`` (``LoraDeltas.chained``)."""
        return None

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The correction of target ``key`` for ``x [T, in]`` -> ``[T, out]`` in x's dtype (None: no slot has
        the key). ``ladders`` is ``LoraBatch.delta``'s; the BGMV kernels are the plain ops' throughput path, which
        has no ladders, so it is not read."""
        if key not in self.pool.a:
            return None
        a, b = self.pool.a[key].to(x.dtype), self.pool.b[key].to(x.dtype)
        return BGMV[self.pool.bgmv](x, a, b, self.pool.scale, self.idx)
