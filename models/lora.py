"""LoRA adapters and how a packed batch of many adapters reaches the decoder.

Owns: ``LoraSpec`` (what a LoraConfig asks for), ``LoraWeights`` (one adapter's trainable A/B
tensors, fp32 on the pool's device, named as PEFT names them so that a saved adapter loads in PEFT
unchanged; ``state_dict`` gives CPU copies for checkpoints) and ``LoraDeltas``, the protocol a packed batch's
adapters answer the decoder with (which token rows belong to which adapter, and their corrections), whose
backends live one per file (``lora_batch``, ``lora_sgmv``, the sampler's ``slots``).
Never touches optimizer state or storage: that is the trainer's and the checkpoint store's.

For target module ``m`` with base weight ``W [O, I]`` the layer computes, per segment ``i``:

    y[seg[i]:seg[i+1]] = x @ W.T + ((x @ A[m].T) * (alpha / rank)) @ B[m].T      A: [r, I], B: [O, r]

``B`` starts at zero, so a fresh adapter equals the base model exactly.

In a mixture-of-experts layer the MLP targets are each expert's: ``experts.{e}.gate_proj`` and so on, an A/B pair
per expert (``layer_targets``), named as PEFT names the per-expert modules of a Hugging Face MoE checkpoint. The
router is never a target (Tinker trains the experts, not the routing).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

import torch

from lathe.kernels import tiling
from lathe.kernels.chain import Segment
from lathe.models.config import ModelConfig

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED = "lm_head"
MAX_RANK = 256
REFERENCE_TILES: Mapping[int, tiling.Ladder] = MappingProxyType({})
"""No ladder for any rank: every LoRA product in the reference tile (``LoraBatch.delta``'s ``ladders``)."""

Key = tuple[int, str]  # (layer index, target); the unembedding is (-1, "lm_head"); an expert's: "experts.3.up_proj"


def expert_target(expert: int, target: str) -> str:
    """The target name of ``target`` (one of ``MLP_TARGETS``) in expert ``expert`` of a sparse layer (with ``""``: the
    expert's prefix, ``"experts.3."``)."""
    return f"experts.{expert}.{target}"


def base_target(target: str) -> str:
    """The module kind of a target: ``"experts.3.up_proj"`` -> ``"up_proj"``; others are their own."""
    return target.rpartition(".")[2]


def mlp_targets(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The MLP targets of ``layer``: ``MLP_TARGETS``, or each of them in every expert of a sparse layer."""
    if not cfg.sparse(layer):
        return MLP_TARGETS
    return tuple(expert_target(e, t) for e in range(cfg.num_experts) for t in MLP_TARGETS)


def layer_targets(cfg: ModelConfig, layer: int, *, attn: bool = True, mlp: bool = True) -> tuple[str, ...]:
    """The targets of ``layer`` in the decoder's order: attention's, then the MLP's (or its experts')."""
    return (ATTN_TARGETS if attn else ()) + (mlp_targets(cfg, layer) if mlp else ())


def shape_keys(cfg: ModelConfig) -> list[Key]:
    """One key of every kind of target module (the shapes a pool's self-check and tile choice cover): attention's
    and the MLP's of the first layer of each kind (dense, sparse: its expert 0), then the unembedding."""
    firsts = {cfg.sparse(i): i for i in reversed(range(cfg.num_layers))}
    keys: list[Key] = [(0, t) for t in ATTN_TARGETS]
    keys += [(i, t) for i in sorted(firsts.values()) for t in mlp_targets(cfg, i)[:len(MLP_TARGETS)]]
    return [*keys, (-1, UNEMBED)]


def weight_name(key: Key) -> str:
    """The Hugging Face name of a target's base weight, without ``.weight``."""
    layer, target = key
    if target == UNEMBED:
        return UNEMBED
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"model.layers.{layer}.{block}.{target}"


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
        keys: list[Key] = [(i, t) for i in range(cfg.num_layers)
                           for t in layer_targets(cfg, i, attn=self.train_attn, mlp=self.train_mlp)]
        if self.train_unembed:
            keys.append((-1, UNEMBED))
        return keys


def module_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target module (an expert's MLP is ``moe_intermediate_size`` wide)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f = cfg.moe_intermediate_size if target.startswith("experts.") else cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h), UNEMBED: (h, cfg.vocab_size),
    }[base_target(target)]


def values_per_rank(cfg: ModelConfig, targets: tuple[str, ...]) -> int:
    """Values of A [r, in] and B [out, r] per unit of rank over the modules of kinds ``targets`` (``MLP_TARGETS``
    counts every expert's), in every layer (the unembedding once): what one more rank of LoRA on them holds, per
    tensor of the adapter (weights, gradients, each optimizer moment)."""
    keys = [(-1, UNEMBED)] if UNEMBED in targets else []
    keys += [(i, t) for i in range(cfg.num_layers) for t in layer_targets(cfg, i) if base_target(t) in targets]
    return sum(sum(module_shape(cfg, t)) for _, t in keys)


def peft_name(key: Key, which: str) -> str:
    """PEFT's state-dict name for ``which`` in {"lora_A", "lora_B"} of a target."""
    return f"base_model.model.{weight_name(key)}.{which}.weight"


def default_seed(model_id: str) -> int:
    """A stable seed for an adapter whose LoraConfig has none."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little")


@dataclass(slots=True)
class LoraWeights:
    """One adapter's trainable tensors (fp32, requires_grad, all on one device).

    ``frozen``: never updated again (a sampler's adapter, loaded from a checkpoint), so copies of its tensors stay
    true and ``columns`` may keep them."""

    spec: LoraSpec
    a: dict[Key, torch.Tensor]
    b: dict[Key, torch.Tensor]
    frozen: bool = False
    _columns: dict[Key, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    def columns(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """``a[key]`` and ``b[key]`` stored column-major (the same matrices, each column contiguous), made once per
        target on first use: the layout in which ``lathe.kernels.chain``'s products of a few rows stream each
        weight as rows (a decode step's LoRA segments). A frozen adapter's only (``frozen``)."""
        if not self.frozen:
            raise ValueError("LoraWeights.columns keeps copies, so only a frozen adapter has them")
        got = self._columns.get(key)
        if got is None:
            got = self._columns[key] = (self.a[key].t().contiguous().t(), self.b[key].t().contiguous().t())
        return got

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
    """What the decoder asks of a packed batch's adapters after each target module's base product. Three backends
    answer it, one file each: ``lora_batch.LoraBatch`` (per segment or grouped on fixed tiles: the invariant CPU
    path of trainer and sampler, and the plain ops' reference), ``lora_sgmv.SgmvBatch`` (the Triton SGMV kernels
    over rank-padded stacks: GPU pools) and the sampler's ``SlotBatch`` (BGMV over resident adapter slots, the
    plain ops' decode throughput path). ``lora_batch.lora_batch`` picks the first two for a pool."""

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The correction ``[T, O]`` of target ``key`` for activations ``x [T, I]``, or None where no adapter of the
        batch has the target; ``ladders``: the pool's LoRA ladders by rank (``Decoder.lora_ladders``), for a backend
        that runs segments on them."""
        ...

    def chained(self, key: Key, x: torch.Tensor,
                ladders: Mapping[int, tiling.Ladder] = REFERENCE_TILES) -> list[Segment] | None:
        """Where ``delta`` of target ``key`` would run every segment through Lathe's kernel, those segments
        (``lathe.kernels.chain.Segment``; [] where none has ``key``), so that the decoder adds them to a lone row's
        base product in one call (``chain.chain_linear``); None for every other way, and from the backends that
        have no such way."""
        ...

    def rows(self, r0: int, r1: int) -> LoraDeltas:
        """The same layout restricted to rows [r0, r1) (chunked LM-head work)."""
        ...

    def take(self, rows: list[int]) -> LoraDeltas:
        """The same layout over rows ``rows`` of the batch (ascending), renumbered from 0: the tokens a
        mixture-of-experts layer routes to one expert."""
        ...


class TrainableDeltas(LoraDeltas, Protocol):
    """A backend a trainer differentiates through: it also names the parameters a target's rows read."""

    def parameters_of(self, key: Key) -> list[torch.Tensor]:
        """The A and B of target ``key`` of every adapter with rows in this batch that has it (each once)."""
        ...

    def rows(self, r0: int, r1: int) -> TrainableDeltas:
        ...

    def take(self, rows: list[int]) -> TrainableDeltas:
        ...


def parameters_of(segments: list[tuple[int, int, LoraWeights]], key: Key) -> list[torch.Tensor]:
    """``TrainableDeltas.parameters_of`` over a batch's ``(s0, s1, adapter)`` segments with rows."""
    out: list[torch.Tensor] = []
    for _, _, w in segments:
        if key in w.a and not any(t is w.a[key] for t in out):
            out += [w.a[key], w.b[key]]
    return out


def row_segments(seg: list[int], ids: list[int], adapters: list[LoraWeights]) -> list[tuple[int, int, LoraWeights]]:
    """``(s0, s1, adapter)`` for each segment of ``seg``/``ids`` that has rows (``seg`` has one more entry than
    ``ids``: rows ``seg[i]:seg[i+1]`` belong to ``adapters[ids[i]]``)."""
    if len(seg) != len(ids) + 1:
        raise ValueError("seg must have one more entry than ids")
    return [(seg[i], seg[i + 1], adapters[w]) for i, w in enumerate(ids) if seg[i + 1] > seg[i]]


def take_rows(seg: list[int], rows: list[int]) -> list[int]:
    """Segment bounds ``seg`` over the rows ``rows`` (ascending) of the batch, renumbered from 0: a segment's
    rows stay contiguous in any ascending subset."""
    return [bisect.bisect_left(rows, s) for s in seg]


def clip_rows(seg: list[int], r0: int, r1: int) -> list[int]:
    """Segment bounds ``seg`` restricted to rows [r0, r1), renumbered from r0."""
    return [min(max(s - r0, 0), r1 - r0) for s in seg]
