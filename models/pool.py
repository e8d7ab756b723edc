"""The options and device choice shared by the two services that run the decoder (trainer and sampler pools).

Both serve the same base models with the same dtype and the same op mode, and they must agree on
all three for the sampler's logprobs to equal the trainer's; one definition (``PoolOptions``, the first fields of
both pools' configs, and so of their flags) keeps them alike.
``--device`` places everything a pool computes with (base weights, RoPE tables, adapters, gradients,
optimizer moments, KV caches, per-step tensors) on one device; the logprobs both pools report are
equal bit for bit only between pools on the same kind of device.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import torch

from lathe.models.decoder import Decoder

T = TypeVar("T")

DEVICES = ("cuda", "cpu")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a pool may hold its frozen base weights in, by flag name (LoRA, gradients and moments stay fp32)."""

AUTO = "auto"
"""The ``--dtype`` that lets the device choose: bf16 where it multiplies bf16 natively, else fp32
(``resolve_dtype``)."""


def default_device() -> str:
    """The pools' default device: ``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bf16(device: str) -> bool:
    """Does ``device`` multiply bf16 in hardware? A CUDA GPU that supports it; a CPU with avx512_bf16 or AMX tiles
    (without either, bf16 products are emulated and slower than fp32)."""
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str, device: str) -> str:
    """The base-weight dtype a pool on ``device`` serves for the flag ``dtype``: itself, or for ``AUTO`` bf16 where
    ``native_bf16(device)`` and fp32 elsewhere. Trainer and sampler pools resolve alike on alike machines; their
    receipts and fingerprints carry the result, so pools that resolved differently are seen not to agree."""
    if dtype == AUTO:
        return "bfloat16" if native_bf16(device) else "float32"
    check_dtype(dtype)
    return dtype


def check_dtype(dtype: str) -> None:
    """Refuse a base-weight dtype that is not one of ``DTYPES``, naming it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")


def check_device(device: str) -> None:
    """Refuse a device a pool cannot run on, naming it: not one of ``DEVICES``, or CUDA without a GPU."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {list(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device here")


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """What a trainer pool and a sampler pool must agree on: the first fields of both configs (each a flag,
    ``lathe.runtime.options``). Made, it has checked the device and resolved ``dtype`` ("auto" becomes what the
    device chose)."""

    models: str = "lathe/tiny-llama"
    """served base models: comma-separated catalog names or model directories"""
    cache_root: Path = Path(".cache/lathe")
    """where models are cached"""
    dtype: str = field(default="float32", metadata={"default": AUTO, "choices": (AUTO, *DTYPES)})
    """the frozen base weights' dtype (flag default auto: bfloat16 where the device multiplies it natively,
    float32 elsewhere); LoRA weights, their gradients and optimizer moments stay fp32"""
    device: str = field(default_factory=default_device, metadata={"choices": DEVICES})
    """where everything the pool computes with lives: base weights, adapters, optimizer state, KV caches
    (default: cuda if present)"""
    invariant: bool = True
    """batch-invariant ops: a row's bits do not depend on its batch, so the sampler's logprobs equal the
    trainer's (off: the plain ops)"""
    sgmv: bool = False
    """LoRA through the Triton SGMV kernels (GPU; set alike on both pools)"""

    def __post_init__(self) -> None:
        check_device(self.device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))


def add_pool_arguments(ap: argparse.ArgumentParser) -> None:
    """A pool process's own flags (its config's come from ``lathe.runtime.options``)."""
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--checkpoints", default="", help="address of the checkpoints service")


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def on_passing_thread(fn: Callable[..., T], *args: object, name: str = "lathe-pool-passing") -> T:
    """``fn(*args)`` run on a thread that ends with it; its result or exception is the caller's.

    Who owns the cores: a pool computes on one long-lived thread (the trainer's cycle, the sampler's
    scheduler), and only that thread may keep OpenMP workers. libgomp gives every thread that enters a
    parallel region a worker team of its own, kept until that thread ends; once the process holds more
    workers than CPUs, every worker spins at most ~100 times before it sleeps, so each of the thousands of
    small parallel ops of a pass pays a futex wake-up. Measured on a 2-core machine: an 8 x 32-token SmolLM2
    cycle took 4.3-6.4 s on the cycle thread after the main thread had loaded the model and created
    adapters, and 2.6-3.2 s when that work ran on a thread that had ended. Work that touches large tensors
    off the compute thread (loading and self-checking a model, creating an adapter) therefore runs here.
    """
    with ThreadPoolExecutor(1, thread_name_prefix=name) as passing:
        return passing.submit(fn, *args).result()


def load_decoder(path: Path | str, name: str, check: Callable[[str, Decoder], object], *, dtype: str, device: str,
                 invariant: bool, sgmv: bool, checkpoint_layers: bool = False) -> Decoder:
    """The base model at ``path`` as a pool serves it under ``name``: ``dtype`` weights on ``device``, the
    invariant ops or the plain ones, LoRA through SGMV or not, its tiles chosen and self-checked by ``check``
    (``PoolExactness.check``) before anyone computes with it. Both pools load their base models here."""
    model = Decoder.from_dir(path, dtype=DTYPES[dtype], device=device, invariant=invariant,
                             checkpoint_layers=checkpoint_layers)
    model.sgmv = sgmv
    check(name, model)
    return model


class OncePerName(Generic[T]):
    """What a pool keeps per served base model, made by ``make(name)`` once, on first use or at warm-up, on a
    passing thread (``on_passing_thread``) and under one lock, so that first uses at once make it once."""

    def __init__(self, make: Callable[[str], T], thread_name: str) -> None:
        self._make, self._thread_name = make, thread_name
        self._made: dict[str, T] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> T:
        with self._lock:
            if name not in self._made:
                self._made[name] = on_passing_thread(self._make, name, name=self._thread_name)
            return self._made[name]

    def values(self) -> list[T]:
        """What is made so far."""
        with self._lock:
            return list(self._made.values())
