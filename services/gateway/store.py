"""The control plane's database: ``ControlStore`` reads and writes it (SQLAlchemy Core, no ORM). With its tables
and their rows (``store_tables``) and the opening and migrating of the database (``store_engine``), the only gateway
code that speaks SQL. Every method is one short transaction, called inline from the gateway's event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import sqlalchemy as sa

from lathe.v1 import lathe_pb2 as pb

from .records import Operation, Run, SamplingSession, SequenceRecord, Session
from .store_engine import create_engine, upgrade
from .store_tables import (
    custom_losses,
    inflight_targets,
    insert_new,
    op_values,
    operations,
    point_values,
    run_from_row,
    run_points,
    run_values,
    runs,
    sampling_from_row,
    sampling_sessions,
    sequence_records,
    session_from_row,
    sessions,
)

MEMORY_URL = "sqlite://"
REPLAYED = ("forward_backward", "optim_step", "save", "load")  # the ordered operations of a training run
MAX_SEQ = 2**62

# the ledger's statements, built once (building a statement per call costs more than SQLite's commit)
_INSERT_OP = operations.insert()
_TOUCH_RUN = runs.update().where(runs.c.model_id == sa.bindparam("m")).values(last_request_time=sa.bindparam("t"))
_HOLDER = sa.select(operations.c.request_id).where(operations.c.key == sa.bindparam("k"),
                                                    operations.c.seq_id == sa.bindparam("s"))
_FINISH = operations.update().where(operations.c.request_id == sa.bindparam("r")).values(
    state="done", result=sa.bindparam("result"), finished=sa.bindparam("finished"))
_RELEASE = _FINISH.values(seq_id=None)
_GET_OP = sa.select(operations).where(operations.c.request_id == sa.bindparam("r"))


@dataclass(frozen=True, slots=True)
class StoreConfig:
    url: str = MEMORY_URL
    """the control plane's database: sqlite:///FILE, postgresql+psycopg://... or sqlite:// (in memory: forgotten
    at exit)"""
    retention_s: float = 7 * 86400.0
    """how long finished operations' results are kept"""
    keep_done: int = 100_000
    """at most this many finished operations' results are kept (the oldest go first)"""
    busy_timeout_ms: int = 10_000
    """SQLite: how long a writer waits for another process's write"""

    def __post_init__(self) -> None:
        if self.retention_s <= 0 or self.keep_done < 1:
            raise ValueError(f"retention_s must be > 0 and keep_done >= 1, got {self.retention_s} and "
                             f"{self.keep_done}")
        if not (self.url.startswith("sqlite:") or self.url.startswith("postgresql+psycopg:")):
            raise ValueError(f"db url {self.url!r} is neither sqlite:///FILE nor postgresql+psycopg://...")


@dataclass(slots=True)
class Loaded:
    """Everything ``ControlStore.load`` finds: the registries and the operations still pending."""

    sessions: list[Session]
    runs: list[Run]
    sampling: list[SamplingSession]
    pending: list[Operation]


class ControlStore:
    def __init__(self, cfg: StoreConfig | None = None) -> None:
        self.cfg = cfg or StoreConfig()
        self.engine = create_engine(self.cfg.url, self.cfg.busy_timeout_ms)
        upgrade(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # ---- registries ----

    def number(self, session_id: str, counter: str, n: int | None) -> int:
        """The session's model or sampler number for a new creation (``counter``: ``"next_model"`` or
        ``"next_sampler"``): ``n`` when the client chose it, else the next one the database hands out. Either
        way the counter ends past it, never lower than another gateway left it."""
        column = sessions.c[counter]
        with self.engine.begin() as c:
            if n is None:
                return c.execute(sessions.update().where(sessions.c.session_id == session_id)
                                 .values({counter: column + 1}).returning(column)).scalar_one() - 1
            c.execute(sessions.update().where(sessions.c.session_id == session_id, column <= n)
                      .values({counter: n + 1}))
            return n

    def get_session(self, session_id: str) -> Session | None:
        with self.engine.begin() as c:
            r = c.execute(sa.select(sessions).where(sessions.c.session_id == session_id)).first()
        return None if r is None else session_from_row(r)

    def get_run(self, model_id: str) -> Run | None:
        with self.engine.begin() as c:
            r = c.execute(sa.select(runs).where(runs.c.model_id == model_id)).first()
        return None if r is None else run_from_row(r)

    def get_sampling(self, sampling_session_id: str) -> SamplingSession | None:
        with self.engine.begin() as c:
            r = c.execute(sa.select(sampling_sessions).where(
                sampling_sessions.c.sampling_session_id == sampling_session_id)).first()
        return None if r is None else sampling_from_row(r)

    def put_session(self, s: Session) -> None:
        with self.engine.begin() as c:
            c.execute(sessions.insert().values(
                session_id=s.session_id, tenant=s.tenant, user_metadata=json.dumps(s.user_metadata),
                next_model=s.next_model, next_sampler=s.next_sampler, finished=s.finished, created_at=s.created_at,
                display_name=s.display_name))

    def list_sessions(self, tenant: str, limit: int, offset: int) -> list[str]:
        """A page of the tenant's session ids, newest first."""
        with self.engine.begin() as c:
            return list(c.execute(sa.select(sessions.c.session_id).where(sessions.c.tenant == tenant)
                                  .order_by(sessions.c.created_at.desc(), sessions.c.session_id)
                                  .limit(limit).offset(offset)).scalars())

    def sessions_after(self, tenant: str, after: tuple[float, str] | None, n: int) -> list[Session]:
        """Up to ``n`` of the tenant's sessions in listing order (newest first, then by id), after the one at
        ``after`` (its ``(created_at, session_id)``), or from the first."""
        query = sa.select(sessions).where(sessions.c.tenant == tenant)
        if after is not None:
            query = query.where(sa.or_(sessions.c.created_at < after[0], sa.and_(
                sessions.c.created_at == after[0], sessions.c.session_id > after[1])))
        with self.engine.begin() as c:
            return [session_from_row(r) for r in c.execute(
                query.order_by(sessions.c.created_at.desc(), sessions.c.session_id).limit(n))]

    def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        """The training run ids and sampling session ids made in the session, oldest first."""
        with self.engine.begin() as c:
            run_ids = c.execute(sa.select(runs.c.model_id).where(runs.c.session_id == session_id)
                                .order_by(runs.c.created_at)).scalars()
            sampler_ids = c.execute(sa.select(sampling_sessions.c.sampling_session_id).where(
                sampling_sessions.c.sampling_session_id.startswith(f"{session_id}:sample:", autoescape=True))
                ).scalars()
            return list(run_ids), sorted(sampler_ids, key=lambda sid: int(sid.rsplit(":", 1)[1]))

    def join_sampling(self, sampling_session_id: str) -> int:
        """A number for a new client of the sampling session, unique among its clients (the first is 0, so
        joiners get 1, 2, ...), counted by the database for every gateway."""
        column = sampling_sessions.c.clients
        with self.engine.begin() as c:
            return c.execute(sampling_sessions.update().where(
                sampling_sessions.c.sampling_session_id == sampling_session_id)
                .values(clients=column + 1).returning(column)).scalar_one()

    def finish_session(self, s: Session) -> None:
        """Record why the session finished (its counters are the database's own, see ``number``)."""
        with self.engine.begin() as c:
            c.execute(sessions.update().where(sessions.c.session_id == s.session_id).values(finished=s.finished))

    def touch_session(self, session_id: str, now: float) -> bool:
        """Record that the open session was heard from at ``now``; False if it has finished (on any gateway)."""
        with self.engine.begin() as c:
            return c.execute(sessions.update().where(sessions.c.session_id == session_id, sessions.c.finished == "")
                             .values(last_seen=now)).rowcount == 1

    def expire_sessions(self, tenant: str, idle_before: float, reason: str) -> list[str]:
        """Finish, with ``reason``, the tenant's open sessions not heard from since ``idle_before`` (their
        ``last_seen``, or ``created_at`` where none); their ids."""
        heard = sa.func.coalesce(sessions.c.last_seen, sessions.c.created_at)
        with self.engine.begin() as c:
            ids = list(c.execute(sa.select(sessions.c.session_id).where(
                sessions.c.tenant == tenant, sessions.c.finished == "", heard < idle_before)).scalars())
            if ids:
                c.execute(sessions.update().where(sessions.c.session_id.in_(ids), sessions.c.finished == "")
                          .values(finished=reason))
        return ids

    def run_configs(self, tenant: str) -> list[tuple[str, pb.LoraConfig, str]]:
        """The base model, LoRA config and optimizer family of each of the tenant's training runs (what their
        adapters take on a trainer: ``quotas.adapter_bytes``)."""
        with self.engine.begin() as c:
            return [(r.base_model, pb.LoraConfig.FromString(r.lora), r.optimizer or "adamw") for r in c.execute(
                sa.select(runs.c.base_model, runs.c.lora, runs.c.optimizer).where(runs.c.tenant == tenant))]

    def open_sessions(self, tenant: str) -> tuple[int, int]:
        """How many of the tenant's sessions are not finished, and the sampling session numbers handed out in them
        (their ``next_sampler`` counters: each sampling session takes one)."""
        numbers = sa.func.coalesce(sa.func.sum(sessions.c.next_sampler), 0)
        with self.engine.begin() as c:
            n, sampling = c.execute(sa.select(sa.func.count(), numbers).where(
                sessions.c.tenant == tenant, sessions.c.finished == "")).one()
        return n, sampling

    def put_run(self, r: Run, create: Operation) -> str:
        """Register a run and its creation operation, both or neither. Returns the request id that creates the
        run: ``create``'s, or the first one's if the id is taken."""
        try:
            with self.engine.begin() as c:
                c.execute(runs.insert().values(model_id=r.model_id, **run_values(r)))
                c.execute(_INSERT_OP, op_values(create))
            return create.request_id
        except sa.exc.IntegrityError:
            with self.engine.begin() as c:
                return c.execute(sa.select(runs.c.create_request_id).where(runs.c.model_id == r.model_id)).scalar_one()

    def update_run(self, r: Run) -> None:
        with self.engine.begin() as c:
            c.execute(runs.update().where(runs.c.model_id == r.model_id).values(**run_values(r)))

    def delete_run(self, model_id: str) -> None:
        with self.engine.begin() as c:
            c.execute(run_points.delete().where(run_points.c.model_id == model_id))
            c.execute(runs.delete().where(runs.c.model_id == model_id))

    def put_sampling(self, rec: SamplingSession) -> None:
        """Register a sampling session (a repeat of its id changes nothing)."""
        with self.engine.begin() as c:
            c.execute(insert_new(self.engine, sampling_sessions).values(
                sampling_session_id=rec.sampling_session_id, tenant=rec.tenant, base_model=rec.base_model,
                model_path=rec.model_path, version=rec.version, follows=rec.follows).on_conflict_do_nothing())

    def set_inflight(self, tenant: str, model_id: str, model_path: str, version: float) -> None:
        """Publish ``model_path`` (saved at ``version``) as run ``model_id``'s inflight weights; an older version
        than the one published (a save replayed after a newer one) changes nothing."""
        with self.engine.begin() as c:
            row = c.execute(sa.select(inflight_targets.c.version).where(
                inflight_targets.c.model_id == model_id)).first()
            if row is None:
                c.execute(inflight_targets.insert().values(model_id=model_id, tenant=tenant, model_path=model_path,
                                                           version=version))
            elif version >= row.version:
                c.execute(inflight_targets.update().where(inflight_targets.c.model_id == model_id).values(
                    model_path=model_path, version=version))

    def put_records(self, tenant: str, rows: list[SequenceRecord], keep: int) -> None:
        """Keep ``rows`` (a repeated id keeps the first), then drop the tenant's oldest records beyond its newest
        ``keep``: no tenant's records push out another's."""
        mine = sequence_records.c.tenant == tenant
        with self.engine.begin() as c:
            insert = insert_new(self.engine, sequence_records)
            for r in rows:
                c.execute(insert.values(sequence_id=r.sequence_id, tenant=tenant, prompt=r.prompt, tokens=r.tokens,
                                        logprobs=r.logprobs, policy=r.policy, created=r.created, expires=r.expires
                                        ).on_conflict_do_nothing())
            cut = c.execute(sa.select(sequence_records.c.created).where(mine).order_by(
                sequence_records.c.created.desc()).offset(keep).limit(1)).scalar()
            if cut is not None:
                c.execute(sequence_records.delete().where(mine, sequence_records.c.created <= cut))

    def records(self, tenant: str, sequence_ids: list[str], now: float, expires: float) -> dict[str, SequenceRecord]:
        """The tenant's unexpired records of ``sequence_ids``, by id, each renewed to expire at ``expires``."""
        found = sa.and_(sequence_records.c.tenant == tenant, sequence_records.c.sequence_id.in_(sequence_ids),
                        sequence_records.c.expires > now)
        with self.engine.begin() as c:
            rows = c.execute(sa.select(sequence_records).where(found)).all()
            c.execute(sequence_records.update().where(found).values(expires=expires))
        return {r.sequence_id: SequenceRecord(r.sequence_id, r.prompt, r.tokens, r.logprobs, r.policy, r.created,
                                              expires) for r in rows}

    def purge_records(self, now: float) -> int:
        """Delete expired sequence records; returns how many went."""
        with self.engine.begin() as c:
            return c.execute(sequence_records.delete().where(sequence_records.c.expires <= now)).rowcount

    def inflight(self, tenant: str, model_id: str) -> tuple[str, float] | None:
        """The tenant's run ``model_id``'s inflight weights (checkpoint path, version), None if it published none."""
        with self.engine.begin() as c:
            r = c.execute(sa.select(inflight_targets).where(inflight_targets.c.model_id == model_id,
                                                            inflight_targets.c.tenant == tenant)).first()
        return None if r is None else (r.model_path, r.version)

    def put_loss(self, tenant: str, loss: pb.CustomLoss, created: float, keep: int) -> None:
        """Keep ``loss`` for ``tenant`` under its ``loss_id`` (a repeated id keeps the first), then drop the
        tenant's oldest losses beyond its newest ``keep``: no tenant's losses push out another's."""
        mine = custom_losses.c.tenant == tenant
        with self.engine.begin() as c:
            c.execute(insert_new(self.engine, custom_losses).values(
                loss_id=loss.loss_id, tenant=tenant, loss=loss.SerializeToString(), created=created
            ).on_conflict_do_nothing())
            older = sa.select(custom_losses.c.loss_id).where(mine).order_by(
                custom_losses.c.created.desc(), custom_losses.c.loss_id.desc()).offset(keep)
            c.execute(custom_losses.delete().where(mine, custom_losses.c.loss_id.in_(older)))

    def get_loss(self, loss_id: str) -> tuple[str, pb.CustomLoss] | None:
        """The tenant and the loss kept as ``loss_id``, if any."""
        with self.engine.begin() as c:
            row = c.execute(sa.select(custom_losses.c.tenant, custom_losses.c.loss)
                            .where(custom_losses.c.loss_id == loss_id)).first()
        return None if row is None else (row.tenant, pb.CustomLoss.FromString(row.loss))

    # ---- the ledger ----

    def add_op(self, op: Operation, run: Run | None = None) -> str:
        """Record ``op`` (and ``run``'s last request time); returns the request id that holds ``(key, seq_id)``:
        ``op``'s, or the one recorded first when that key is taken already."""
        try:
            with self.engine.begin() as c:
                c.execute(_INSERT_OP, op_values(op))
                if run is not None:
                    c.execute(_TOUCH_RUN, {"m": run.model_id, "t": run.last_request_time})
            return op.request_id
        except sa.exc.IntegrityError:
            with self.engine.begin() as c:
                holder = c.execute(_HOLDER, {"k": op.key, "s": op.seq_id}).scalar()
            if holder is None:  # not the key (the request id itself is taken), or released since: the caller's
                raise
            return holder

    def finish_op(self, request_id: str, result: pb.FutureResult, finished: float, release_key: bool,
                  tenant: str = "") -> None:
        """Record the result; ``release_key``: it answers no ``seq_id`` (a submit that failed on its way in). A
        training step's metrics become a point of its run's curves (``run_points``)."""
        point = point_values(result, tenant, finished)
        with self.engine.begin() as c:
            c.execute(_RELEASE if release_key else _FINISH,
                      {"r": request_id, "result": result.SerializeToString(), "finished": finished})
            if point is not None:
                c.execute(insert_new(self.engine, run_points).values(**point).on_conflict_do_nothing())

    def run_points(self, tenant: str, model_id: str, after_seq: int = -1, limit: int = 5000) -> list[dict]:
        """The tenant's run ``model_id``'s first ``limit`` curve points after ``seq_id`` ``after_seq``, in order:
        dicts of ``seq_id``, ``step``, ``op``, ``metrics`` (name -> value) and ``finished``."""
        with self.engine.begin() as c:
            rows = c.execute(sa.select(run_points).where(
                run_points.c.model_id == model_id, run_points.c.tenant == tenant, run_points.c.seq_id > after_seq)
                .order_by(run_points.c.seq_id, run_points.c.op).limit(limit)).all()
        return [{"seq_id": r.seq_id, "step": r.step, "op": r.op, "metrics": json.loads(r.metrics),
                 "finished": r.finished} for r in rows]

    def get_op(self, request_id: str) -> Operation | None:
        with self.engine.begin() as c:
            row = c.execute(_GET_OP, {"r": request_id}).first()
        return None if row is None else Operation(**row._mapping)

    def purge(self, now: float) -> int:
        """Delete finished operations older than the retention, then all but the ``keep_done`` newest; returns
        how many went. Kept whatever their age: a live run's operations after its recovery snapshot, which a
        rebuild on a restarted trainer replays (``replay``)."""
        snapshot_seq = sa.select(runs.c.recovery_seq).where(runs.c.model_id == operations.c.key).scalar_subquery()
        replayable = sa.and_(operations.c.kind.in_(REPLAYED), operations.c.seq_id.is_not(None),
                             operations.c.seq_id > sa.func.coalesce(snapshot_seq, MAX_SEQ))
        done = sa.and_(operations.c.state == "done", sa.not_(replayable))
        with self.engine.begin() as c:
            old = operations.c.finished < now - self.cfg.retention_s
            gone = c.execute(operations.delete().where(done, old)).rowcount
            cut = c.execute(sa.select(operations.c.finished).where(done).order_by(operations.c.finished.desc())
                            .offset(self.cfg.keep_done).limit(1)).scalar()
            if cut is not None:
                gone += c.execute(operations.delete().where(done, operations.c.finished <= cut)).rowcount
        return gone

    def replay(self, model_id: str, first: int) -> list[Operation]:
        """The run's recorded operations from ``seq_id`` ``first`` on, in order (what a rebuild applies again)."""
        with self.engine.begin() as c:
            return [Operation(**r._mapping) for r in c.execute(
                sa.select(operations).where(operations.c.key == model_id, operations.c.seq_id >= first,
                                            operations.c.kind.in_(REPLAYED)).order_by(operations.c.seq_id))]

    def load(self) -> Loaded:
        with self.engine.begin() as c:
            found = Loaded(
                sessions=[session_from_row(r) for r in c.execute(sa.select(sessions))],
                runs=[run_from_row(r) for r in c.execute(sa.select(runs))],
                sampling=[sampling_from_row(r) for r in c.execute(sa.select(sampling_sessions))],
                pending=[Operation(**r._mapping) for r in c.execute(
                    sa.select(operations).where(operations.c.state == "pending").order_by(operations.c.created))],
            )
        return found
