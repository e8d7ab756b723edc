"""The sampler's adapter cache: saved sampler checkpoints turned into ``LoraWeights``, LRU-bounded.

    key (tenant, path, version)  ->  LoraWeights (A/B in fp32, or the pool dtype for SGMV; on the pool device)

A checkpoint is a PEFT adapter: ``adapter_model.safetensors`` (PEFT tensor names) plus
``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``; see ``lathe.trainer.bank``).
``version`` is the checkpoint's creation time: the gateway pins it when a sampling client is bound,
and a checkpoint overwritten since then is refused (never silently served in its newer form).
Bytes come from an ``AdapterSource`` (the checkpoints service in production); the cache itself never
touches storage. Evicting an adapter only drops the cache's reference: sequences still decoding with
it keep theirs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from lathe.errors import FailedPrecondition, InvalidArgument
from lathe.models.config import ModelConfig
from lathe.models.lora import ATTN_TARGETS, MLP_TARGETS, UNEMBED, LoraSpec, LoraWeights
from lathe.models.pool import on_passing_thread

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"

Key = tuple[str, str, float]  # (tenant, path, version)


class AdapterSource(Protocol):
    """Where checkpoint bytes come from."""

    def get(self, tenant: str, path: str) -> tuple[dict[str, bytes], float]:
        """The files of the checkpoint at ``path`` and its version (creation time, seconds)."""
        ...


def spec_from_peft(config: dict) -> LoraSpec:
    """``LoraSpec`` from a PEFT ``adapter_config.json``: rank ``r``, alpha ``lora_alpha``, and which
    target groups are trained from ``target_modules``."""
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        modules = [modules]
    known = set(ATTN_TARGETS) | set(MLP_TARGETS) | {UNEMBED}
    unknown = sorted(set(modules) - known)
    if unknown:
        raise InvalidArgument(f"adapter_config target_modules {unknown} are not LoRA targets Lathe serves "
                              f"({sorted(known)})")
    try:
        return LoraSpec(rank=int(config["r"]), alpha=float(config.get("lora_alpha", config["r"])),
                        train_attn=any(m in ATTN_TARGETS for m in modules),
                        train_mlp=any(m in MLP_TARGETS for m in modules),
                        train_unembed=UNEMBED in modules)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgument(f"adapter_config.json is not a usable LoRA config: {e}") from None


def adapter_dtype(pool_dtype: torch.dtype, sgmv: bool) -> torch.dtype:
    """The dtype a sampler pool keeps adapters in: fp32 for the per-segment LoRA path (which computes in
    fp32 from the trainer's fp32 master weights), the pool dtype for the SGMV kernels (which compute in the
    activation dtype on trainer and sampler alike)."""
    return pool_dtype if sgmv else torch.float32


def fetch_checkpoint(source: AdapterSource | None, tenant: str, path: str, version: float) -> dict[str, bytes]:
    """The files of the sampler checkpoint at ``path`` as they were at ``version`` (the time the sampling client was
    bound to it): ``FailedPrecondition`` when there is no store, or when the checkpoint was overwritten since."""
    if source is None:
        raise FailedPrecondition(f"this sampler has no checkpoint store configured, so it cannot load {path}")
    files, stored = source.get(tenant, path)
    if stored != version:
        raise FailedPrecondition(f"the checkpoint at {path} was overwritten after this sampling client was "
                                 f"bound (bound to version {version}, the store now holds {stored}); "
                                 "create a new sampling client to sample from the new weights")
    return files


def peft_config(files: dict[str, bytes], base_model: str) -> dict:
    """The ``adapter_config.json`` of a sampler checkpoint's ``files``, checked: both PEFT files present, and
    trained on ``base_model`` (the model the request samples)."""
    missing = [f for f in (WEIGHTS_FILE, CONFIG_FILE) if f not in files]
    if missing:
        raise InvalidArgument(f"checkpoint has no {missing}: not a sampler checkpoint")
    config = json.loads(files[CONFIG_FILE])
    trained_on = config.get("base_model_name_or_path")
    if trained_on and trained_on != base_model:
        raise FailedPrecondition(f"checkpoint was trained on {trained_on!r}, this request samples {base_model!r}")
    return config


def load_adapter(files: dict[str, bytes], cfg: ModelConfig, dtype: torch.dtype, base_model: str,
                 device: str | torch.device = "cpu") -> LoraWeights:
    """Build an adapter for base model ``cfg`` from a checkpoint's files; tensors cast to ``dtype`` on
    ``device``.

    The pool asks for fp32 (its per-segment LoRA path computes in fp32, as the trainer does from its fp32
    master weights) or, for the SGMV kernels, the activation dtype that path casts to on every call.
    """
    spec = spec_from_peft(peft_config(files, base_model))
    weights = LoraWeights.init(cfg, spec, seed=0)
    try:
        weights.load_state_dict(st_load(files[WEIGHTS_FILE]))
    except (ValueError, SafetensorError) as e:
        raise InvalidArgument(f"checkpoint tensors do not fit {base_model!r}: {e}") from None
    return LoraWeights(spec, {k: t.detach().to(device=device, dtype=dtype) for k, t in weights.a.items()},
                       {k: t.detach().to(device=device, dtype=dtype) for k, t in weights.b.items()}, frozen=True)


class AdapterCache:
    """LRU cache of loaded adapters; concurrent requests for one missing key share one load."""

    def __init__(self, source: AdapterSource | None, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"adapter cache capacity must be >= 1, got {capacity}")
        self.source, self.capacity = source, capacity
        self._lru: OrderedDict[Key, LoraWeights] = OrderedDict()
        self._loading: dict[Key, Future[LoraWeights]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, tenant: str, path: str, version: float, cfg: ModelConfig, dtype: torch.dtype,
            base_model: str, device: str | torch.device = "cpu") -> LoraWeights:
        """The adapter saved at ``path`` as it was at ``version``; loads it on a miss (blocking)."""
        key = (tenant, path, version)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return self._lru[key]
            pending = self._loading.get(key)
            owner = pending is None
            if owner:
                pending = self._loading[key] = Future()
        if not owner:
            return pending.result()
        try:
            weights = on_passing_thread(self._fetch, key, cfg, dtype, base_model, device, name="sampler-adapter")
        except BaseException as e:
            with self._lock:
                del self._loading[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._loading[key]
            self._lru[key] = weights
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        pending.set_result(weights)
        return weights

    def _fetch(self, key: Key, cfg: ModelConfig, dtype: torch.dtype, base_model: str,
               device: str | torch.device) -> LoraWeights:
        return load_adapter(fetch_checkpoint(self.source, *key), cfg, dtype, base_model, device)
