"""The native sampler pool's options (``SamplerConfig``, one flag each on ``python -m lathe.sampler``) and what it needs
from the model catalog (``Catalog``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from lathe.models.pool import PoolOptions
from lathe.sampler.blocks import BLOCK
from lathe.sampler.graphs import BUCKETS, GraphConfig
from lathe.sampler.slots import BGMV


class CatalogEntry(Protocol):
    name: str
    path: Path
    max_context_length: int


class Catalog(Protocol):
    """What the engine needs from ``lathe.models.catalog.ModelCatalog``."""

    def resolve(self, name: str) -> CatalogEntry:
        """The served model called ``name``; ``KeyError`` when there is none."""
        ...

    def entries(self) -> list[CatalogEntry]: ...


@dataclass(frozen=True, slots=True)
class SamplerConfig(PoolOptions):
    """The sampler pool's configuration; ``python -m lathe.sampler`` has a flag for each field (``--max-running``
    for ``max_running``; ``--no-prefix-cache`` for a field that defaults to True), its help the field's docstring."""

    engine: Literal["native", "sglang"] = "native"
    """what samples: native (Lathe's own engine, bitwise equal to the trainer when invariant) or sglang (an SGLang
    server, --sglang-url: its throughput and LoRA batching, not bitwise equal to the trainer)"""
    sglang_url: str = ""
    """engine sglang: the base URL of the pool's SGLang server, e.g. http://127.0.0.1:30000"""
    sglang_adapter_dir: str = ""
    """engine sglang: where adapters are published as PEFT directories for the SGLang server to load; the same path
    must hold the same files for the server (a volume the sampler and SGLang containers share)"""
    sglang_timeout_s: float = 600.0
    """engine sglang: the longest wait for one answer of the SGLang server"""
    max_running: int = 64
    """sequences decoding at once (each sample of a request is one)"""
    max_queue: int = 1024
    """requests accepted but not yet running"""
    adapter_cache: int = 16
    """adapters kept loaded (engine sglang: in the SGLang server, the least recently used unloaded past this; at most
    the server's --max-loaded-loras)"""
    max_prefill_tokens: int = 4096
    """prompt tokens admitted per step (a lone request always fits)"""
    max_running_tokens: int = 128 * 8192
    """running budget: tokens (num_samples x (prompt + max_tokens)) the running requests reserve together (128
    samples of 8k context); one request asking for more is refused"""
    loaders: int = 2
    """threads that load models and adapters and check requests"""
    kv_blocks: int = 0
    """KV cache blocks of 64 tokens per base model (0: enough for max_running_tokens)"""
    prefix_cache: bool = True
    """reuse cached KV blocks of a shared prompt prefix"""
    bgmv: Literal["auto", "off", "torch", "triton"] = "auto"
    """decode-step LoRA through the adapter slot pool by BGMV: off, torch (the reference), triton; auto: triton
    with sgmv on cuda when not invariant (the throughput path: no bitwise equality with the trainer)"""
    adapter_slots: int = 16
    """adapters resident in the slot pool per base model (BGMV path)"""
    slot_rank: int = 32
    """largest LoRA rank a slot holds; a step with a larger one runs the per-segment path"""
    cuda_graphs: bool = True
    """replay decode steps from CUDA graphs (cuda only)"""
    graph_buckets: tuple[int, ...] = field(default=BUCKETS, metadata={"cli": False})
    """batch sizes decode steps are padded to and captured at"""

    def __post_init__(self) -> None:
        PoolOptions.__post_init__(self)  # (a slots dataclass has no zero-argument super())
        for name in ("max_running", "max_queue", "adapter_cache", "max_prefill_tokens", "max_running_tokens",
                     "loaders"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_blocks < 0 or self.kv_blocks == 1:
            raise ValueError(f"kv_blocks must be 0 (derived) or >= 2 (one is the null block), got {self.kv_blocks}")
        if self.bgmv not in ("auto", "off", *BGMV):
            raise ValueError(f"bgmv {self.bgmv!r} is not one of {['auto', 'off', *sorted(BGMV)]}")
        if self.bgmv in BGMV and self.invariant:
            raise ValueError(f"bgmv {self.bgmv!r} is the throughput path; the invariant mode keeps the per-segment "
                             "LoRA ops that match the trainer bit for bit (turn invariant off)")
        if self.bgmv == "triton" and self.device != "cuda":
            raise ValueError(f"bgmv 'triton' needs device 'cuda', got {self.device!r}")
        for name in ("adapter_slots", "slot_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        GraphConfig(self.graph_buckets)  # checks the buckets
        if self.engine not in ("native", "sglang"):
            raise ValueError(f"engine {self.engine!r} is not one of ['native', 'sglang']")
        if self.engine == "sglang":
            if not self.sglang_url.startswith(("http://", "https://")):
                raise ValueError(f"engine 'sglang' needs --sglang-url, the SGLang server's http(s):// base URL; got "
                                 f"{self.sglang_url!r}")
            if not self.sglang_adapter_dir:
                raise ValueError("engine 'sglang' needs --sglang-adapter-dir, a directory the SGLang server reads too")
            if self.sglang_timeout_s <= 0:
                raise ValueError(f"sglang_timeout_s must be > 0, got {self.sglang_timeout_s}")

    @property
    def decode_bgmv(self) -> str:
        """The BGMV implementation of decode steps' LoRA, or "off" (the per-segment path)."""
        if self.bgmv != "auto":
            return self.bgmv
        return "triton" if self.sgmv and not self.invariant and self.device == "cuda" else "off"

    @property
    def pool_blocks(self) -> int:
        """KV blocks per base model: ``kv_blocks``, or by default what ``max_running_tokens`` can fill (every
        sequence may leave one block partly empty) plus the null block."""
        return self.kv_blocks or self.max_running_tokens // BLOCK + self.max_running + 1
