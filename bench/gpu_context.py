"""What every section of ``bench/gpu_check.py`` shares: the shapes (``Sizes``: ``FULL``, a 1B-class Llama, and
``SMOKE``, tiny), the ``Context`` a section records into, timing (``sync``, ``median_s``) and random models,
adapters and tokens drawn on the device (no download). Trainer adapters are fp32 on the device, the base in
``--dtype``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from lathe.kernels.sgmv_triton import triton_available
from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.pool import DTYPES
from lathe.models.tiny import hf_config, tensor_shapes
from lathe.trainer.validate import Example

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every shape the sections use."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rank: int  # LoRA rank of every adapter
    tenants: int  # cycle: tenants, each with one sequence of ``tenant_tokens``
    tenant_tokens: int
    sequences: int  # sampler: sequences over ``adapters`` adapters
    adapters: int
    prompt_tokens: int
    new_tokens: int
    repeats: int  # timed runs after one warm-up (median reported)
    sgmv: tuple[int, int, int, int]  # kernel problem: tokens, hidden, rank, adapters
    decode_context: int  # decode section: tokens already cached per sequence in the attention timing


FULL = Sizes(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000, rank=32, tenants=8,
             tenant_tokens=128, sequences=64, adapters=8, prompt_tokens=64, new_tokens=64, repeats=3,
             sgmv=(4096, 4096, 32, 8), decode_context=1024)
SMOKE = Sizes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, rank=4, tenants=4,
              tenant_tokens=16, sequences=8, adapters=4, prompt_tokens=8, new_tokens=4, repeats=1,
              sgmv=(256, 256, 8, 4), decode_context=100)


@dataclass(slots=True)
class Context:
    """What a section knows, and where it records: ``record`` rewrites ``path`` at once, so a section killed
    at its time limit still leaves what it had measured."""

    path: Path
    scratch: Path
    device: str
    dtype: str
    sizes: Sizes
    protos: str  # how lathe.v1 was imported (the generated code, or a stub and why)
    data: dict[str, Any] = field(default_factory=lambda: {"status": "running", "results": {}})

    def record(self, key: str, value: object) -> None:
        self.data["results"][key] = value
        self.write()

    def skip(self, reason: str) -> None:
        self.data.update(status="skipped", reason=reason)
        self.write()

    def fail(self, exc: BaseException) -> None:
        self.data.update(status="error", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# ---------------------------------------------------------------- shared pieces


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_s(ctx: Context, run: Callable[[], T]) -> tuple[float, T]:
    """Median wall seconds of ``run`` over ``repeats`` timed calls after one warm-up call, and the last
    call's result."""
    result = run()
    times = []
    for _ in range(ctx.sizes.repeats):
        sync(ctx.device)
        t0 = time.perf_counter()
        result = run()
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def random_model(ctx: Context, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor], Decoder]:
    """(HF config, HF-named weights in the pool dtype on the device, the decoder over them)."""
    s = ctx.sizes
    config = hf_config("llama", vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       head_dim=s.hidden // s.heads, max_position_embeddings=2048, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    weights = {}
    for name, shape in tensor_shapes(config).items():  # norms U(0.5, 1.5), matrices N(0, 1/fan_in), as tiny.py
        if name.endswith("norm.weight"):
            t = torch.rand(shape, generator=gen, device=ctx.device) + 0.5
        else:
            t = torch.randn(shape, generator=gen, device=ctx.device) / shape[1] ** 0.5
        weights[name] = t.to(DTYPES[ctx.dtype])
    model = Decoder.from_weights(ModelConfig.from_hf(config), weights, dtype=DTYPES[ctx.dtype], device=ctx.device)
    return config, weights, model


def random_adapters(ctx: Context, cfg: ModelConfig, n: int) -> list[LoraWeights]:
    """``n`` fp32 trainer adapters of rank ``sizes.rank`` on every target, B random and non-zero."""
    out = []
    for i in range(n):
        w = LoraWeights.init(cfg, LoraSpec(rank=ctx.sizes.rank), seed=100 + i, device=ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(200 + i)
        with torch.no_grad():
            for b in w.b.values():
                b.copy_(torch.randn(b.shape, generator=gen, device=ctx.device) * 0.01)
        out.append(w)
    return out


def example(tokens: list[int]) -> Example:
    return Example(tokens[:-1], torch.tensor(tokens[1:]), {"weights": torch.ones(len(tokens) - 1)})


def random_tokens(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    return torch.randint(vocab, (rows, length), generator=torch.Generator().manual_seed(seed)).tolist()


def gpu_variants(ctx: Context) -> list[bool]:
    """The LoRA paths to measure: per-segment everywhere, SGMV too where the Triton kernels run."""
    return [False, True] if ctx.cuda and triton_available() else [False]
