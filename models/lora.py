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
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from lathe.kernels import ops
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
    """What the decoder asks of a packed batch's adapters after each target module's base product. Three backends
    answer it, one file each: ``lora_batch.LoraBatch`` (per segment or grouped on fixed tiles: the invariant CPU
    path of trainer and sampler, and the plain ops' reference), ``lora_sgmv.SgmvBatch`` (the Triton SGMV kernels
    over rank-padded stacks: GPU pools) and the sampler's ``SlotBatch`` (BGMV over resident adapter slots, the
    plain ops' decode throughput path). ``lora_batch.lora_batch`` picks the first two for a pool."""

    def delta(self, key: Key, x: torch.Tensor,
              ladders: Mapping[int, ops.Ladder] = REFERENCE_TILES) -> torch.Tensor | None:
        """The correction ``[T, O]`` of target ``key`` for activations ``x [T, I]``, or None where no adapter of the
        batch has the target; ``ladders``: the pool's LoRA ladders by rank (``Decoder.lora_ladders``), for a backend
        that runs segments on them."""
        ...

    def rows(self, r0: int, r1: int) -> LoraDeltas:
        """The same layout restricted to rows [r0, r1) (chunked LM-head work)."""
        ...


class TrainableDeltas(LoraDeltas, Protocol):
    """A backend a trainer differentiates through: it also names the parameters a target's rows read."""

    def parameters_of(self, key: Key) -> list[torch.Tensor]:
        """The A and B of target ``key`` of every adapter with rows in this batch that has it (each once)."""
        ...

    def rows(self, r0: int, r1: int) -> TrainableDeltas:
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


def clip_rows(seg: list[int], r0: int, r1: int) -> list[int]:
    """Segment bounds ``seg`` restricted to rows [r0, r1), renumbered from r0."""
    return [min(max(s - r0, 0), r1 - r0) for s in seg]
