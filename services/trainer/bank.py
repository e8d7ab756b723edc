"""The adapter bank: every training run's LoRA weights, optimizer state (AdamW or Dimuon) and step count.

Owns ``Adapter`` records keyed by model id, and their byte formats for the checkpoint store:

    training state ("weights")     adapter_model.safetensors  PEFT-named LoRA A/B (fp32)
                                   adapter_config.json        PEFT LoraConfig
                                   optimizer.safetensors      the family's tensors (lathe.trainer.optim_state)
                                   trainer_state.json         step, optimizer family, base model, lora config, dtype
    sampler weights                adapter_model.safetensors + adapter_config.json (loads in PEFT as is)

Checkpoints go through the checkpoints service (the engine moves those bytes); the bank itself only
pages adapters out to, and back in from, a local scratch directory when more runs exist than fit in memory.
A resident adapter's weights, gradients and moments live on the pool's device (fp32 whatever the base
dtype); the bytes above are written from, and read back through, CPU copies.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
from safetensors.torch import load as st_load

from lathe.errors import FailedPrecondition, InvalidArgument
from lathe.models.config import ModelConfig
from lathe.models.host import safetensors_bytes, to_device
from lathe.models.lora import ATTN_TARGETS, MLP_TARGETS, UNEMBED, LoraSpec, LoraWeights
from lathe.trainer.optim_state import OptimState, family_of, new_state, state_from_tensors, state_tensors

FORMAT_VERSION = 1


@dataclass(slots=True)
class Adapter:
    model_id: str
    tenant: str
    base_model: str
    weights: LoraWeights
    opt: OptimState
    last_used: float = field(default_factory=time.monotonic)

    @property
    def spec(self) -> LoraSpec:
        return self.weights.spec

    @property
    def step(self) -> int:
        return self.opt.step

    @classmethod
    def fresh(cls, model_id: str, tenant: str, base_model: str, cfg: ModelConfig, spec: LoraSpec,
              seed: int, device: str | torch.device = "cpu", optimizer: str = "adamw") -> Adapter:
        weights = LoraWeights.init(cfg, spec, seed, device)
        return cls(model_id, tenant, base_model, weights, new_state(optimizer, weights.named_parameters()))

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.weights.parameters())

    # ---- bytes ----

    def peft_config(self) -> dict:
        spec = self.spec
        targets = list(ATTN_TARGETS if spec.train_attn else ()) + list(MLP_TARGETS if spec.train_mlp else ())
        if spec.train_unembed:
            targets.append(UNEMBED)
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": targets, "fan_in_fan_out": False, "inference_mode": True,
        }

    def sampler_files(self) -> dict[str, bytes]:
        return {
            "adapter_model.safetensors": safetensors_bytes(self.weights.named_parameters()),
            "adapter_config.json": json.dumps(self.peft_config(), indent=1).encode(),
        }

    def state_files(self, dtype: str) -> dict[str, bytes]:
        state = {"format_version": FORMAT_VERSION, "step": self.opt.step, "optimizer": family_of(self.opt),
                 "base_model": self.base_model,
                 "lora": asdict(self.spec), "dtype": dtype}
        return {
            **self.sampler_files(),
            "optimizer.safetensors": safetensors_bytes(state_tensors(self.opt)),
            "trainer_state.json": json.dumps(state, indent=1).encode(),
        }

    def load_files(self, files: dict[str, bytes], *, with_optimizer: bool) -> None:
        """Replace weights (and optimizer state + step when ``with_optimizer``: the state's own family) from a
        training state; without it the run keeps its family, starting over.

        Everything is read and checked before anything is replaced: a bad checkpoint changes nothing.
        """
        state = read_state(files)
        if state["base_model"] != self.base_model:
            raise FailedPrecondition(f"checkpoint was trained on {state['base_model']!r}, this run uses "
                                     f"{self.base_model!r}")
        if LoraSpec(**state["lora"]) != self.spec:
            raise FailedPrecondition(f"checkpoint lora config {state['lora']} differs from this run's "
                                     f"{asdict(self.spec)}")
        params = self.weights.named_parameters()
        weights = to_device(st_load(files["adapter_model.safetensors"]), next(iter(params.values())).device)
        opt = new_state(family_of(self.opt), params)
        if with_optimizer:
            if "optimizer.safetensors" not in files:
                raise FailedPrecondition("checkpoint has no optimizer state (is it a sampler checkpoint?)")
            opt = state_from_tensors(state.get("optimizer", "adamw"), st_load(files["optimizer.safetensors"]),
                                     params, int(state["step"]))
        try:
            self.weights.load_state_dict(weights)
        except ValueError as e:
            raise FailedPrecondition(f"checkpoint does not fit this run: {e}") from None
        self.opt = opt
        for p in params.values():
            p.grad = None

    # ---- paging (weights + moments + accumulated gradients, bit for bit; on CUDA every tensor moves through
    # pinned host memory with non_blocking copies, lathe.models.host) ----

    def page_files(self, dtype: str) -> dict[str, bytes]:
        grads = {n: p.grad for n, p in self.weights.named_parameters().items() if p.grad is not None}
        return {**self.state_files(dtype), "grads.safetensors": safetensors_bytes(grads)}

    def restore_page(self, files: dict[str, bytes]) -> None:
        self.load_files(files, with_optimizer=True)
        params = self.weights.named_parameters()
        grads = to_device(st_load(files["grads.safetensors"]), next(iter(params.values())).device)
        for n, p in params.items():
            p.grad = grads.get(n)


def read_state(files: dict[str, bytes]) -> dict:
    if "trainer_state.json" not in files:
        raise InvalidArgument("path is not a training state (no trainer_state.json); "
                              "use a tinker://<run>/weights/<name> path")
    state = json.loads(files["trainer_state.json"])
    if state.get("format_version") != FORMAT_VERSION:
        raise FailedPrecondition(f"training state format {state.get('format_version')} is not supported")
    return state



class PageStore(Protocol):
    """Where paged-out adapters live (``lathe.trainer.pages.DirPages``: local scratch)."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def keys(self, prefix: str) -> list[str]: ...

    def delete(self, key: str) -> None: ...


@dataclass(slots=True)
class _Slot:
    tenant: str
    base_model: str
    spec: LoraSpec
    adapter: Adapter | None  # None: paged out


class AdapterBank:
    """Every training run's adapter; at most ``capacity`` resident, the least recently used paged out.

    A tenant may also have its own resident limit (``limit_tenant``: its quota): beyond it, that tenant's own
    least recently used adapters are paged out, never another tenant's. Either way ``pinned`` adapters (the
    cycle computing now) stay, so a cycle may hold more for as long as it runs, never more after it.

    Paging writes weights, AdamW moments, step and accumulated gradients to ``pages`` and reads them
    back bit for bit, so a paged run's results do not change. ``cfg_of(base_model)`` gives the model
    config a paged adapter is rebuilt against, on ``device``.
    """

    def __init__(self, capacity: int, pages: PageStore, dtype: str, cfg_of: Callable[[str], ModelConfig],
                 device: str | torch.device = "cpu") -> None:
        if capacity < 1:
            raise ValueError(f"adapter bank capacity must be >= 1, got {capacity}")
        self.capacity, self.pages, self.dtype, self.cfg_of, self.device = capacity, pages, dtype, cfg_of, device
        self._slots: dict[str, _Slot] = {}
        self._tenant_limits: dict[str, int] = {}  # tenant -> its resident quota (absent: only capacity binds)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._slots

    def add(self, adapter: Adapter) -> Adapter:
        """Register a new run's adapter (a repeat of the same id returns the existing one)."""
        slot = self._slots.setdefault(adapter.model_id,
                                      _Slot(adapter.tenant, adapter.base_model, adapter.spec, adapter))
        return self.get(adapter.model_id) if slot.adapter is None else slot.adapter

    def tenant(self, model_id: str) -> str:
        return self._slots[model_id].tenant

    def limit_tenant(self, tenant: str, max_resident: int) -> None:
        """Hold at most ``max_resident`` of ``tenant``'s adapters in memory from the next ``evict`` (0: no limit
        of its own)."""
        if max_resident < 0:
            raise ValueError(f"max_resident for tenant {tenant!r} must be >= 0, got {max_resident}")
        if max_resident:
            self._tenant_limits[tenant] = max_resident
        else:
            self._tenant_limits.pop(tenant, None)

    def base_model(self, model_id: str) -> str:
        return self._slots[model_id].base_model

    def get(self, model_id: str) -> Adapter:
        """The adapter, paged in if it was out (the caller then holds it until ``evict`` runs)."""
        slot = self._slots[model_id]
        if slot.adapter is None:
            prefix = _page_prefix(model_id)
            files = {k[len(prefix):]: self.pages.get(k) for k in self.pages.keys(prefix)}
            adapter = Adapter.fresh(model_id, slot.tenant, slot.base_model, self.cfg_of(slot.base_model),
                                    slot.spec, 0, self.device)
            adapter.restore_page(files)
            for k in list(files):
                self.pages.delete(prefix + k)
            slot.adapter = adapter
        slot.adapter.last_used = time.monotonic()
        return slot.adapter

    def evict(self, pinned: set[str]) -> int:
        """Page out least recently used adapters (never ``pinned`` ones): first each tenant's own beyond its
        limit, then anyone's until within capacity. Returns how many were paged out."""
        lru = sorted((s.adapter.last_used, mid) for mid, s in self._slots.items()
                     if s.adapter is not None and mid not in pinned)
        held = Counter(s.tenant for s in self._slots.values() if s.adapter is not None)
        kept = []
        for last_used, mid in lru:
            tenant = self._slots[mid].tenant
            if held[tenant] > self._tenant_limits.get(tenant, held[tenant]):
                self._page_out(mid)
                held[tenant] -= 1
            else:
                kept.append((last_used, mid))
        paged, resident = len(lru) - len(kept), sum(held.values())
        for _, mid in kept[:max(0, resident - self.capacity)]:
            self._page_out(mid)
            paged += 1
        return paged

    def _page_out(self, model_id: str) -> None:
        adapter = self._slots[model_id].adapter
        assert adapter is not None
        for name, data in adapter.page_files(self.dtype).items():
            self.pages.put(_page_prefix(model_id) + name, data)
        self._slots[model_id].adapter = None

    @property
    def resident(self) -> int:
        return sum(s.adapter is not None for s in self._slots.values())

    @property
    def paged(self) -> int:
        return len(self._slots) - self.resident


def _page_prefix(model_id: str) -> str:
    return f"paged/{hashlib.sha256(model_id.encode()).hexdigest()[:32]}/"
