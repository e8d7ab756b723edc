"""The control plane's tables (SQLAlchemy Core) and the conversion between their rows and the gateway's records
(``records.py``); ``store.ControlStore`` is the only reader and writer.

Tables (created only by the alembic migration in ``migrations/``, which ``store_engine.upgrade`` runs; alembic's
``alembic_version`` table says it ran; ``metadata`` is the schema it makes, checked by a test):
- ``sessions``: session id -> tenant, metadata, the next model and sampler numbers, why it finished, when it
  was created (listings are newest first), its display name (NULL: none), when it was last heard from (NULL: not
  since it was created);
- ``runs``: model id -> tenant (its owner), session, base model, LoRA config (``pb.LoraConfig`` bytes),
  optimizer family, metadata, creation and last-request times, the last checkpoints, the request id of its
  creation;
- ``sampling_sessions``: sampling session id -> tenant, base model, pinned checkpoint and version, how many
  clients joined it (``join_sampling``), and for an inflight session the run whose inflight weights it follows;
- ``inflight_targets``: model id -> tenant, the sampler checkpoint its latest inflight save published and its
  version (``set_inflight``: what its inflight sessions sample from);
- ``sequence_records``: sequence id -> tenant, the prompt, sampled tokens and their sampling-time logprobs (int32 /
  float32 bytes), the policy that sampled them, when it was recorded and when it expires (``lathe.gateway.stability``:
  a tenant keeps its newest ``TenantQuotas.max_sequence_records``; each use renews one);
- ``custom_losses``: loss id -> tenant, the checked loss (``pb.CustomLoss`` bytes), when it was created (a
  tenant keeps its newest ``TenantQuotas.max_custom_losses``);
- ``run_points``: one row per finished forward_backward or optim_step of a run -> its tenant, ``seq_id``, the
  adapter's step, the operation, its metrics (JSON) and when it finished: the curves the console draws, kept for the
  run's life (written with the operation's result, ``finish_op``);
- ``operations``, the ledger: request id -> tenant, key (model id or sampling session id), ``seq_id``, kind,
  the serialized request sent on, state (``pending``/``done``), the serialized ``pb.FutureResult`` and times.
  ``(key, seq_id)`` is unique (NULL while an operation answers no ``seq_id``), so the database, not a
  process, decides which request a ``seq_id`` names; a finished operation's row (its ``seq_id`` with it)
  is deleted after ``retention_s`` or when more than ``keep_done`` finished rows exist (``purge``).
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from lathe.v1 import lathe_pb2 as pb

from .records import Operation, Run, SamplingSession, Session

metadata = sa.MetaData()
sessions = sa.Table(
    "sessions", metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("user_metadata", sa.Text, nullable=False),
    sa.Column("next_model", sa.Integer, nullable=False),
    sa.Column("next_sampler", sa.Integer, nullable=False),
    sa.Column("finished", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False, server_default="0"),
    sa.Column("display_name", sa.String(256), nullable=True),
    sa.Column("last_seen", sa.Float, nullable=True),
    sa.Index("ix_sessions_tenant_created", "tenant", "created_at"),
)
runs = sa.Table(
    "runs", metadata,
    sa.Column("model_id", sa.String(128), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False, index=True),
    sa.Column("session_id", sa.String(64), nullable=False),
    sa.Column("base_model", sa.String(256), nullable=False),
    sa.Column("lora", sa.LargeBinary, nullable=False),
    sa.Column("user_metadata", sa.Text, nullable=False),
    sa.Column("create_request_id", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_request_time", sa.Float, nullable=False),
    sa.Column("last_checkpoint", sa.Text, nullable=False),
    sa.Column("last_checkpoint_time", sa.Float, nullable=False),
    sa.Column("last_sampler_checkpoint", sa.Text, nullable=False),
    sa.Column("last_sampler_checkpoint_time", sa.Float, nullable=False),
    sa.Column("recovery_seq", sa.BigInteger, nullable=False),
    sa.Column("optimizer", sa.String(16), nullable=True),  # NULL: recorded before families existed, AdamW
)
sampling_sessions = sa.Table(
    "sampling_sessions", metadata,
    sa.Column("sampling_session_id", sa.String(128), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("base_model", sa.String(256), nullable=False),
    sa.Column("model_path", sa.Text, nullable=False),
    sa.Column("version", sa.Float, nullable=False),
    sa.Column("clients", sa.Integer, nullable=False, server_default="0"),
    sa.Column("follows", sa.String(128), nullable=False, server_default=""),
)
sequence_records = sa.Table(
    "sequence_records", metadata,
    sa.Column("sequence_id", sa.String(160), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("prompt", sa.LargeBinary, nullable=False),
    sa.Column("tokens", sa.LargeBinary, nullable=False),
    sa.Column("logprobs", sa.LargeBinary, nullable=False),
    sa.Column("policy", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("expires", sa.Float, nullable=False),
    sa.Index("ix_sequence_records_tenant_created", "tenant", "created"),
    sa.Index("ix_sequence_records_expires", "expires"),
)
inflight_targets = sa.Table(
    "inflight_targets", metadata,
    sa.Column("model_id", sa.String(128), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("model_path", sa.Text, nullable=False),
    sa.Column("version", sa.Float, nullable=False),
)
custom_losses = sa.Table(
    "custom_losses", metadata,
    sa.Column("loss_id", sa.String(128), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("loss", sa.LargeBinary, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Index("ix_custom_losses_tenant_created", "tenant", "created"),
)
run_points = sa.Table(
    "run_points", metadata,
    sa.Column("model_id", sa.String(128), nullable=False),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("seq_id", sa.BigInteger, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("op", sa.String(32), nullable=False),
    sa.Column("metrics", sa.Text, nullable=False),
    sa.Column("finished", sa.Float, nullable=False),
    sa.PrimaryKeyConstraint("model_id", "seq_id", "op"),
)
operations = sa.Table(
    "operations", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(256), nullable=False),
    sa.Column("key", sa.String(128), nullable=False),
    sa.Column("seq_id", sa.BigInteger, nullable=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("request", sa.LargeBinary, nullable=False),
    sa.Column("sampling_seq_id", sa.BigInteger, nullable=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("result", sa.LargeBinary, nullable=True),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("finished", sa.Float, nullable=True),
    sa.UniqueConstraint("key", "seq_id", name="uq_operations_key_seq"),
    sa.Index("ix_operations_state_finished", "state", "finished"),
)


def session_from_row(r: sa.Row) -> Session:
    return Session(r.session_id, r.tenant, json.loads(r.user_metadata), r.next_model, r.next_sampler,
                   finished=r.finished, created_at=r.created_at, display_name=r.display_name)


def run_from_row(r: sa.Row) -> Run:
    return Run(r.model_id, r.tenant, r.session_id, r.base_model, pb.LoraConfig.FromString(r.lora),
               json.loads(r.user_metadata), r.create_request_id, r.created_at, r.last_request_time, r.last_checkpoint,
               r.last_checkpoint_time, r.last_sampler_checkpoint, r.last_sampler_checkpoint_time, r.recovery_seq,
               optimizer=r.optimizer or "adamw")


def run_values(r: Run) -> dict[str, object]:
    """A ``runs`` row's columns but its key, from ``r``."""
    return {"tenant": r.tenant, "session_id": r.session_id, "base_model": r.base_model,
            "lora": r.lora.SerializeToString(), "user_metadata": json.dumps(r.user_metadata),
            "create_request_id": r.create_request_id, "created_at": r.created_at,
            "last_request_time": r.last_request_time, "last_checkpoint": r.last_checkpoint,
            "last_checkpoint_time": r.last_checkpoint_time, "last_sampler_checkpoint": r.last_sampler_checkpoint,
            "last_sampler_checkpoint_time": r.last_sampler_checkpoint_time, "recovery_seq": r.recovery_seq,
            "optimizer": r.optimizer}


def sampling_from_row(r: sa.Row) -> SamplingSession:
    return SamplingSession(r.sampling_session_id, r.tenant, r.base_model, r.model_path, r.version, r.follows)


def op_values(op: Operation) -> dict[str, object]:
    return {"request_id": op.request_id, "tenant": op.tenant, "key": op.key, "seq_id": op.seq_id, "kind": op.kind,
            "request": op.request, "sampling_seq_id": op.sampling_seq_id, "state": op.state, "result": op.result,
            "created": op.created, "finished": op.finished}


def point_values(result: pb.FutureResult, tenant: str, finished: float) -> dict | None:
    """A ``run_points`` row for a training step's result (None for any other result, an error, or no metrics)."""
    kind = result.WhichOneof("result")
    if kind not in ("forward_backward", "optim_step") or not result.receipt.model_id:
        return None
    metrics = dict(getattr(result, kind).metrics)
    if not metrics:
        return None
    return {"model_id": result.receipt.model_id, "tenant": tenant, "seq_id": result.receipt.seq_id,
            "step": result.receipt.adapter_step, "op": kind, "metrics": json.dumps(metrics), "finished": finished}


def insert_new(engine: Engine, table: sa.Table) -> sqlite.Insert | postgresql.Insert:
    """An INSERT into ``table`` in ``engine``'s dialect, whose ``on_conflict_do_nothing`` keeps a row already there."""
    return (sqlite.insert if engine.dialect.name == "sqlite" else postgresql.insert)(table)
