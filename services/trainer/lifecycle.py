"""Making a training run: base models, adapters (fresh, from a saved training state, from a recovery snapshot)
and the recovery snapshots themselves.

``BaseModels`` owns the pool's base models: one ``Decoder`` per served name, loaded and self-checked once
(``PoolExactness``), on first use or at warm-up, on a passing thread. ``RunMaker`` makes adapters and reads and
writes recovery snapshots through the ``CheckpointStore`` (``lathe.trainer.recovery``); it holds no run. The
engine (``lathe.trainer.engine``) owns the runs it makes and decides when a snapshot is due.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lathe.errors import FailedPrecondition, InvalidArgument, NotFound
from lathe.models.catalog import ModelCatalog
from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder
from lathe.models.exactness import PoolExactness
from lathe.models.lora import ATTN_TARGETS, MLP_TARGETS, UNEMBED, LoraSpec, default_seed, values_per_rank
from lathe.models.pool import OncePerName, load_decoder
from lathe.trainer.bank import Adapter, read_state
from lathe.trainer.config import TrainerConfig
from lathe.trainer.optim_state import check_family, family_of
from lathe.trainer.plan import Files
from lathe.trainer.recovery import Record
from lathe.types import RECOVERY_KIND, RECOVERY_NAME
from lathe.v1 import lathe_pb2 as pb


class CheckpointStore(Protocol):
    """What the trainer needs from the checkpoints service (see ``lathe.checkpoints.client``)."""

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: dict[str, bytes],
            metadata_json: str, ttl_seconds: int, overwrite: bool, max_tenant_bytes: int = 0) -> str: ...

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]: ...


@functools.cache
def lora_cost(path: Path) -> pb.LoraCost:
    """What LoRA costs per rank on the model in ``path`` (its config alone), for the gateway's adapter-bytes quota."""
    cfg = ModelConfig.from_dir(path)
    return pb.LoraCost(attn_values_per_rank=values_per_rank(cfg, ATTN_TARGETS),
                       mlp_values_per_rank=values_per_rank(cfg, MLP_TARGETS),
                       unembed_values_per_rank=values_per_rank(cfg, (UNEMBED,)))


class BaseModels:
    def __init__(self, cfg: TrainerConfig, catalog: ModelCatalog, exactness: PoolExactness) -> None:
        self.cfg, self.catalog, self.exactness = cfg, catalog, exactness
        self._loaded = OncePerName(self._load, "trainer-load")

    def get(self, name: str) -> Decoder:
        """The served base model ``name``, loaded and self-checked once (``OncePerName``)."""
        return self._loaded.get(name)

    def _load(self, name: str) -> Decoder:
        try:
            entry = self.catalog.resolve(name)
        except KeyError as e:
            raise NotFound(str(e.args[0]) if e.args else f"unknown base model {name!r}") from None
        c = self.cfg
        return load_decoder(entry.path, name, self.exactness.check, dtype=c.dtype, device=c.device,
                            invariant=c.invariant, sgmv=c.sgmv, checkpoint_layers=c.activation_checkpointing)

    def capabilities(self) -> pb.ServerCapabilities:
        """Every served model with its length, this pool's exactness report and its LoRA cost."""
        return pb.ServerCapabilities(supported_models=[
            pb.SupportedModel(model_name=e.name, max_context_length=e.max_context_length,
                              trainer_exactness=pb.Exactness(**self.exactness.fields(e.name)),
                              lora_cost=lora_cost(e.path))
            for e in self.catalog.entries()
        ])


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A run's recovery snapshot before its record: whose it is, its manifest fields and its state files (the
    adapter's page files, serialized when the snapshot was taken; empty: a record alone, no state)."""

    tenant: str
    model_id: str
    meta: dict[str, object]
    files: Files


class RunMaker:
    def __init__(self, cfg: TrainerConfig, bases: BaseModels, store: CheckpointStore | None) -> None:
        self.cfg, self.bases, self._store = cfg, bases, store

    def fresh(self, req: pb.CreateAdapterRequest) -> Adapter:
        """A new adapter from ``req``'s LoRA config: its initialization is a deterministic function of that config
        and the model id, so a fresh run's rebuild makes the same one."""
        c = req.lora_config
        try:
            spec = LoraSpec(rank=c.rank, seed=c.seed if c.HasField("seed") else None, train_attn=c.train_attn,
                            train_mlp=c.train_mlp, train_unembed=c.train_unembed,
                            **({"alpha": c.alpha} if c.HasField("alpha") else {}))  # else LoraSpec's default
        except ValueError as e:
            raise InvalidArgument(f"lora_config: {e}") from None
        model = self.bases.get(req.base_model)
        seed = spec.seed if spec.seed is not None else default_seed(req.model_id)
        return Adapter.fresh(req.model_id, req.tenant, req.base_model, model.cfg, spec, seed, self.cfg.device,
                             check_family(req.optimizer))

    def from_state(self, req: pb.CreateAdapterRequest, files: Files) -> Adapter:
        state = read_state(files)
        base_model = state["base_model"]
        spec = LoraSpec(**state["lora"])
        adapter = Adapter.fresh(req.model_id, req.tenant, base_model, self.bases.get(base_model).cfg, spec, 0,
                                self.cfg.device, check_family(req.optimizer))
        adapter.load_files(files, with_optimizer=req.with_optimizer)
        return adapter

    def snapshot_files(self, req: pb.CreateAdapterRequest) -> Files:
        """The files of the run's recovery snapshot. Every run has one from its creation on, so a missing one
        (expired after ``ttl_s`` idle, swept, or written before runs had one from creation) is an error that names
        the run: a fresh adapter in its place would silently lose its steps or the state it started from."""
        try:
            return self.store().get(tenant=req.tenant, path=req.recover_from)
        except NotFound:
            raise FailedPrecondition(
                f"run {req.model_id!r} cannot be rebuilt on this trainer: its recovery snapshot {req.recover_from} "
                "is missing (expired or swept), and a fresh adapter in its place would silently lose what the run "
                "had trained; start a new run (from a saved training state of this one, if one is kept)") from None

    def from_snapshot(self, req: pb.CreateAdapterRequest, files: dict[str, bytes]) -> Adapter:
        """A run as its recovery snapshot left it: weights, moments, step and pending gradients."""
        state = read_state(files)
        adapter = Adapter.fresh(req.model_id, req.tenant, state["base_model"], self.bases.get(state["base_model"]).cfg,
                                LoraSpec(**state["lora"]), 0, self.cfg.device)
        adapter.restore_page(files)
        return adapter

    def take_snapshot(self, adapter: Adapter, *, state: bool = True) -> Snapshot:
        """``adapter`` as its recovery snapshot holds it, serialized now (its page files; none unless ``state``), so
        the run may go on training while ``write_snapshot`` stores the bytes on another thread.

        Serialized here, on the caller's thread (the cycle thread), because copying tensors is ATen work: a
        writer thread that ran it would enter OpenMP regions and keep a worker team of its own, and once the
        process holds more workers than CPUs every parallel op of every later cycle pays a futex wake-up
        (``lathe.models.pool.on_passing_thread``). Measured on a 2-core EPYC: 8 tenants x 128 tokens took 6.9-9.4
        s a round with snapshots every 10 steps, against 5.7-7.2 s without, in every round after the first
        write. The writer threads now only move bytes."""
        return Snapshot(adapter.tenant, adapter.model_id, {"base_model": adapter.base_model, "step": adapter.step},
                        adapter.page_files(self.cfg.dtype) if state else {})

    def write_snapshot(self, snapshot: Snapshot, record: Record) -> None:
        """Store ``snapshot`` with ``record`` (``recovery.json``) as the run's recovery snapshot."""
        self.store().put(tenant=snapshot.tenant, run_id=snapshot.model_id, kind=RECOVERY_KIND, name=RECOVERY_NAME,
                         files={**snapshot.files, **record.files()},
                         metadata_json=json.dumps({**snapshot.meta, "seq_id": record.seq_id}),
                         ttl_seconds=self.cfg.snapshots.ttl_s, overwrite=True)

    def info(self, a: Adapter) -> pb.AdapterInfo:
        s = a.spec
        return pb.AdapterInfo(
            model_id=a.model_id, base_model=a.base_model, step=a.step, dtype=self.cfg.dtype, optimizer=family_of(a.opt),
            lora_config=pb.LoraConfig(rank=s.rank, alpha=s.alpha, train_attn=s.train_attn,
                                      train_mlp=s.train_mlp, train_unembed=s.train_unembed,
                                      **({"seed": s.seed} if s.seed is not None else {})),
        )

    def store(self) -> CheckpointStore:
        if self._store is None:
            raise InvalidArgument("this trainer has no checkpoint store configured")
        return self._store
