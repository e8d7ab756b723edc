"""LoRA adapters and how a packed batch of many adapters reaches the decoder.

Owns: ``LoraSpec`` (what a LoraConfig asks for), ``LoraWeights`` (one adapter's trainable A/B
tensors, fp32 on the pool's device, named as PEFT names them so that a saved adapter loads in PEFT
unchanged; ``state_dict`` gives CPU copies for checkpoints) and
``LoraBatch`` (the segment layout of a packed batch: which token rows belong to which adapter).
Never touches optimizer state or storage: that is the trainer's and the checkpoint store's.

For target module ``m`` with base weight ``W [O, I]`` the layer computes, per segment ``i``:

    y[seg[i]:seg[i+1]] = x @ W.T + ((x @ A[m].T) * (alpha / rank)) @ B[m].T      A: [r, I], B: [O, r]

``B`` starts at zero, so a fresh adapter equals the base model exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

import torch
import torch.nn.functional as F

from lathe.kernels import ops
from lathe.kernels.lora_grouped import TileLayout, lora_grouped, stacks
from lathe.models.config import ModelConfig

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED = "lm_head"
MAX_RANK = 256
REFERENCE_TILES: Mapping[int, ops.Ladder] = MappingProxyType({})
"""No ladder for any rank: every LoRA product in the reference tile (``LoraBatch.delta``'s ``ladders``)."""

Key = tuple[int, str]  # (layer index, target); the unembedding is (-1, "lm_head")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A LoraConfig as the model sees it. ``alpha`` defaults to 32 (Tinker's convention)."""

    rank: int = 32
    alpha: float = 32.0
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"lora rank must be in [1, {MAX_RANK}], got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora alpha must be a positive number, got {self.alpha}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("lora config trains nothing: train_attn, train_mlp and train_unembed are all false")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def keys(self, cfg: ModelConfig) -> list[Key]:
        targets = (ATTN_TARGETS if self.train_attn else ()) + (MLP_TARGETS if self.train_mlp else ())
        keys: list[Key] = [(i, t) for i in range(cfg.num_layers) for t in targets]
        if self.train_unembed:
            keys.append((-1, UNEMBED))
        return keys


def module_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target module."""
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h), UNEMBED: (h, cfg.vocab_size),
    }[target]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatched op when it is one already (a decode step runs this ~800 times)."""
    return t if t.dtype == dtype else t.to(dtype)


def _lone_tile(ladder: ops.Ladder, rows: int, x: torch.Tensor, a: torch.Tensor) -> int:
    """``ops.lone_height`` out of autograd (under it, ``ops.linear``'s differentiable products run); 0 in it."""
    if torch.is_grad_enabled() and (x.requires_grad or a.requires_grad):
        return 0
    return ops.lone_height(ladder, rows, x.device)


def values_per_rank(cfg: ModelConfig, targets: tuple[str, ...]) -> int:
    """Values of A [r, in] and B [out, r] per unit of rank over ``targets``, in every layer (the unembedding once):
    what one more rank of LoRA on them holds, per tensor of the adapter (weights, gradients, each optimizer moment)."""
    return sum(sum(module_shape(cfg, t)) * (1 if t == UNEMBED else cfg.num_layers) for t in targets)


def peft_name(key: Key, which: str) -> str:
    """PEFT's state-dict name for ``which`` in {"lora_A", "lora_B"} of a target."""
    layer, target = key
    if target == UNEMBED:
        return f"base_model.model.lm_head.{which}.weight"
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.{which}.weight"


def default_seed(model_id: str) -> int:
    """A stable seed for an adapter whose LoraConfig has none."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little")


@dataclass(slots=True)
class LoraWeights:
    """One adapter's trainable tensors (fp32, requires_grad, all on one device)."""

    spec: LoraSpec
    a: dict[Key, torch.Tensor]
    b: dict[Key, torch.Tensor]

    @classmethod
    def init(cls, cfg: ModelConfig, spec: LoraSpec, seed: int, device: str | torch.device = "cpu") -> LoraWeights:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform default), B = 0, on ``device``.

        A is drawn on the CPU, so a seed gives the same bits on every device.
        """
        gen = torch.Generator().manual_seed(seed)
        a, b = {}, {}
        for key in spec.keys(cfg):
            fan_in, fan_out = module_shape(cfg, key[1])
            bound = 1.0 / math.sqrt(fan_in)
            a[key] = (torch.rand(spec.rank, fan_in, generator=gen) * 2 - 1).mul_(bound).to(device).requires_grad_()
            b[key] = torch.zeros(fan_out, spec.rank, device=device, requires_grad=True)
        return cls(spec, a, b)

    def parameters(self) -> list[torch.Tensor]:
        return [t for key in self.a for t in (self.a[key], self.b[key])]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key in self.a:
            out[peft_name(key, "lora_A")] = self.a[key]
            out[peft_name(key, "lora_B")] = self.b[key]
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies by PEFT name (what checkpoints hold, whichever device the adapter lives on)."""
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.named_parameters().items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy saved tensors in (from any device), by PEFT name; refuses missing, extra or mis-shaped
        tensors."""
        own = self.named_parameters()
        missing = sorted(set(own) - set(tensors))
        extra = sorted(set(tensors) - set(own))
        if missing or extra:
            raise ValueError(f"adapter tensors do not match its config: missing {missing[:3]}, extra {extra[:3]}")
        for name, param in own.items():
            if tuple(tensors[name].shape) != tuple(param.shape):
                raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {tuple(param.shape)}")
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(tensors[name])


class LoraDeltas(Protocol):
    """What the decoder asks of a packed batch's adapters after each target module's base product. Two backends
    answer it: ``LoraBatch`` (per segment, grouped or SGMV: the trainer's, and the sampler's in invariant mode) and
    the sampler's ``SlotBatch`` (BGMV over resident adapter slots, the plain ops' throughput path)."""

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, ops.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The correction ``[T, O]`` of target ``key`` for activations ``x [T, I]``, or None where no adapter of the
        batch has the target; ``ladders``: the pool's LoRA ladders by rank (``Decoder.lora_ladders``), for a backend
        that runs segments on them."""
        ...


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
    triton: bool = False  # SGMV kernels on stacked, rank-padded weights (GPU); else the per-segment path
    _segments: list[tuple[int, int, LoraWeights]] = field(default_factory=list)
    _layouts: dict[tuple[tuple[int, int, int], ...], TileLayout] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.seg) != len(self.ids) + 1:
            raise ValueError("seg must have one more entry than ids")
        self._segments = [
            (self.seg[i], self.seg[i + 1], self.adapters[w])
            for i, w in enumerate(self.ids)
            if self.seg[i + 1] > self.seg[i]
        ]

    def rows(self, r0: int, r1: int) -> LoraBatch:
        """The same layout restricted to rows [r0, r1) (for chunked LM-head work)."""
        seg = [min(max(s - r0, 0), r1 - r0) for s in self.seg]
        return LoraBatch(seg, list(self.ids), self.adapters, self.invariant, self.triton)

    def parameters_of(self, key: Key) -> list[torch.Tensor]:
        """The A and B of target ``key`` of every adapter with rows in this batch that has it (each once)."""
        out: list[torch.Tensor] = []
        for _, _, w in self._segments:
            if key in w.a and not any(t is w.a[key] for t in out):
                out += [w.a[key], w.b[key]]
        return out

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, ops.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The LoRA correction of target ``key`` for activations ``x [T, I]`` -> ``[T, O]`` or None.

        Computed in fp32 (fp64 for fp64 activations) whatever the base dtype: the precision policy keeps
        LoRA weights, their products and gradients in fp32 under a bf16 base; the caller rounds once.
        Invariant mode runs every segment of one rank through one grouped shrink and expand
        (``lathe.kernels.lora_grouped``), with the bits of ``delta_per_segment``; a batch of one segment out of
        autograd (a decode step of one adapter) runs ``delta_per_segment`` itself: the same products in fewer
        ops, over the ladder the pool admitted for its rank (``ladders``, by rank: the decoder's
        ``lora_ladders``), which has the reference tile's bits. So does a batch out of autograd whose grouped
        product could not stack its adapters' weights (``_per_segment``).
        """
        holders = [w for _, _, w in self._segments if key in w.a]
        if not holders:
            return None
        if self.triton:
            return self._delta_sgmv(key, x, holders[0].b[key].shape[0])
        if not self.invariant or (not torch.is_grad_enabled() and self._per_segment(key, x, holders, ladders)):
            return self.delta_per_segment(key, x, ladders)
        out = None
        for rank in sorted({w.spec.rank for w in holders}):
            layout, members = self._layout(key, rank, x)
            part = lora_grouped(x, layout, [w.a[key] for w in members], [w.b[key] for w in members],
                                [w.spec.scale for w in members])
            out = part if out is None else out + part  # each part is zero outside its own rows
        return out

    def _per_segment(self, key: Key, x: torch.Tensor, holders: list[LoraWeights],
                     ladders: Mapping[int, ops.Ladder]) -> bool:
        """Whether ``key`` runs faster per segment, over its ranks' ladders, than grouped: one segment, or an expand
        the grouped product cannot stack (``lora_grouped.stacks``: the LM head's over several adapters), which it
        would run one segment at a time anyway, in one-thread products (measured on a 2-core EPYC, 4 adapters x 8
        decode rows at rank 32: 24 ms grouped, 7 ms per segment on the direct ladder)."""
        if len(self._segments) == 1:
            return True
        if any(not ladders.get(w.spec.rank, ops.REFERENCE).direct for w in holders):  # no direct products
            return False
        for rank in {w.spec.rank for w in holders}:
            layout, members = self._layout(key, rank, x)
            expand = members[0].b[key]
            c0, c1 = ops.col_blocks(rank, expand.shape[0], expand.element_size())[0]  # the expand's first block
            if not stacks(layout, expand[c0:c1]):
                return True
        return False

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
            layout = self._layouts[cache_key] = TileLayout.build(x.shape[0], spans, ops.ROW_TILE, x.device)
        return layout, members

    def delta_per_segment(self, key: Key, x: torch.Tensor,
                          ladders: Mapping[int, ops.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
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
            a, b, ladder = _as(w.a[key], wide), _as(w.b[key], wide), ladders.get(w.spec.rank, ops.REFERENCE)
            tile = _lone_tile(ladder, s1 - s0, x, a)
            if tile:  # both products in one zero-padded direct tile, as ``ops.linear`` runs each of them
                v = ops.direct_tile(F.pad(xs, (0, 0, 0, tile - (s1 - s0))), a.t())
                parts.append(ops.direct_tile(v * w.spec.scale, b.t())[:s1 - s0])
                continue
            v = ops.linear(xs, a, invariant=self.invariant, ladder=ladder)
            parts.append(ops.linear(v * w.spec.scale, b, invariant=self.invariant, ladder=ladder))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _delta_sgmv(self, key: Key, x: torch.Tensor, out_features: int) -> torch.Tensor:
        """The same correction through one SGMV shrink and one expand over all segments.

        Adapters are stacked with ranks zero-padded to the largest; an adapter without ``key`` gets zero
        matrices. Padding changes the reduction length, so these bits are not the per-segment path's:
        a pool runs one path for trainer and sampler alike.
        """
        from lathe.kernels.sgmv_triton import lora_delta_triton

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
