"""The control plane's store (``lathe.gateway.store``) on SQLite and on a live PostgreSQL, and the gateway core
over it: what a restarted core finds, which request a ``seq_id`` names, expiry, migrations, internal retries."""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from lathe.errors import NotFound, ResourceExhausted, Unavailable
from lathe.gateway.calls import Caller, CallPolicy
from lathe.gateway.core import GatewayCore
from lathe.gateway.records import Operation, Run, SamplingSession, SequenceRecord, Session
from lathe.gateway.store import ControlStore, StoreConfig
from lathe.gateway.store_engine import upgrade
from lathe.gateway.store_tables import metadata
from lathe.v1 import lathe_pb2 as pb


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A real PostgreSQL 16 server in a temporary directory, on a Unix socket; stopped after the module."""
    import pgserver

    with tempfile.TemporaryDirectory(prefix="lathe-pg-") as root:
        server = pgserver.get_server(root, cleanup_mode="stop")
        try:
            yield server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
        finally:
            server.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/control.db"
        return
    base = request.getfixturevalue("postgres")
    name = f"t_{tmp_path.name.lower().replace('-', '_')[:40]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    url = sa.make_url(base).set(database=name)
    yield url.render_as_string(hide_password=False)


def op(rid: str, seq: int | None, key: str = "m", kind: str = "optim_step") -> Operation:
    return Operation(rid, "t", key, seq, kind, pb.TrainerOp(model_id=key, seq_id=seq or 0).SerializeToString())


def test_the_migrated_schema_is_the_stores_and_migrations_run_once(db_url: str) -> None:
    first = ControlStore(StoreConfig(db_url))
    first.put_session(Session("s1", "t", {}))
    second = ControlStore(StoreConfig(db_url))  # a restart (or a second gateway): nothing runs again, nothing lost
    with second.engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c), metadata) == []
        assert c.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == ["0001"]  # the head
    upgrade(second.engine)
    assert [s.session_id for s in second.load().sessions] == ["s1"]
    first.close()
    second.close()


def test_a_sampling_session_row_without_follows_is_a_snapshot_session_and_inflight_weights_move_forward(
        tmp_path: Path) -> None:
    """A sampling session written without ``follows`` (the column's default) is a snapshot session: it follows no
    run. Inflight targets only move forward and stay per tenant."""
    url = f"sqlite:///{tmp_path}/old.db"
    engine = sa.create_engine(url)
    upgrade(engine)
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO sampling_sessions (sampling_session_id, tenant, base_model, model_path, version,"
                          " clients) VALUES ('s:sample:0', 't', 'b', 'tinker://p', 1.5, 0)"))
    engine.dispose()
    store = ControlStore(StoreConfig(url))
    assert store.get_sampling("s:sample:0") == SamplingSession("s:sample:0", "t", "b", "tinker://p", 1.5, "")
    assert store.inflight("t", "m") is None
    store.set_inflight("t", "m", "tinker://m/sampler_weights/a", 2.0)
    store.set_inflight("t", "m", "tinker://m/sampler_weights/old", 1.0)  # a replayed older save: no step back
    assert store.inflight("t", "m") == ("tinker://m/sampler_weights/a", 2.0)
    store.set_inflight("t", "m", "tinker://m/sampler_weights/b", 3.0)
    assert store.inflight("t", "m") == ("tinker://m/sampler_weights/b", 3.0)
    assert store.inflight("intruder", "m") is None  # another tenant's run is not found
    store.close()


def test_sequence_records_expire_unless_used_and_each_tenant_keeps_its_newest(db_url: str) -> None:
    """A record lives a day after its last use (here: expires at 10, each read renews it to the read's time + 100);
    a tenant over its quota loses its own oldest records, never another tenant's; no tenant reads another's."""
    store = ControlStore(StoreConfig(db_url))

    def rec(sid: str, created: float, expires: float = 10.0) -> SequenceRecord:
        return SequenceRecord(sid, b"\1\0\0\0", b"\2\0\0\0", b"\0\0\0\0", "tinker://r/sampler_weights/a", created,
                              expires)

    store.put_records("alice", [rec("a:0", 1.0), rec("a:1", 2.0)], keep=2)
    store.put_records("bob", [rec("b:0", 1.5)], keep=2)
    assert set(store.records("alice", ["a:0", "a:1", "b:0"], now=5.0, expires=105.0)) == {"a:0", "a:1"}
    assert store.records("alice", ["a:0"], now=50.0, expires=150.0)["a:0"].expires == 150.0  # renewed at 5: alive
    assert store.records("bob", ["b:0"], now=50.0, expires=150.0) == {}  # never used: expired at 10
    assert store.purge_records(now=50.0) == 1  # bob's
    store.put_records("alice", [rec("a:2", 3.0, expires=100.0)], keep=2)  # over its quota: its own oldest goes
    assert set(store.records("alice", ["a:0", "a:1", "a:2"], now=60.0, expires=160.0)) == {"a:1", "a:2"}
    assert store.records("alice", ["a:1"], now=200.0, expires=300.0) == {}  # a day unused
    store.close()


def test_custom_losses_keep_the_first_of_an_id_and_each_tenants_newest(db_url: str) -> None:
    store = ControlStore(StoreConfig(db_url))
    try:
        for i in range(5):
            store.put_loss("mallory", pb.CustomLoss(loss_id=f"m:{i}", name=f"v{i}"), created=float(i), keep=2)
        store.put_loss("victim", pb.CustomLoss(loss_id="v:0", name="mine"), created=0.5, keep=2)
        store.put_loss("victim", pb.CustomLoss(loss_id="v:0", name="again"), created=9.0, keep=2)  # a repeat
        assert [store.get_loss(f"m:{i}") is None for i in range(5)] == [True, True, True, False, False]
        assert store.get_loss("m:4") == ("mallory", pb.CustomLoss(loss_id="m:4", name="v4"))
        assert store.get_loss("v:0") == ("victim", pb.CustomLoss(loss_id="v:0", name="mine"))
    finally:
        store.close()


def test_records_round_trip(db_url: str) -> None:
    store = ControlStore(StoreConfig(db_url))
    s = Session("s1", "alice", {"who": "me"})
    store.put_session(s)
    run = Run("s1:train:0", "alice", "s1", "base/x", pb.LoraConfig(rank=8, alpha=16.0, seed=3), {"k": "v"},
              create_request_id="req-c", created_at=100.5, last_request_time=101.25)
    assert store.number("s1", "next_model", None) == 0
    create = op("req-c", None, "s1:train:0", "create_model")
    assert store.put_run(run, create) == "req-c"
    assert store.put_run(run, op("req-d", None, "s1:train:0", "create_model")) == "req-c"  # id taken: the first
    run.last_checkpoint, run.last_checkpoint_time = "tinker://s1:train:0/weights/a", 102.0
    store.update_run(run)
    s.finished = "success"
    assert store.number("s1", "next_sampler", 1) == 1  # the client's own number moves the counter past it
    store.put_sampling(SamplingSession("s1:sample:1", "alice", "base/x", "tinker://p", 7.5))
    store.put_sampling(SamplingSession("s1:sample:1", "alice", "other", "", 0.0))  # a repeat changes nothing
    store.put_sampling(SamplingSession("s1:sample:2", "alice", "base/x", "tinker://q", 8.5, follows=run.model_id))
    store.finish_session(s)
    result = pb.FutureResult(request_id="req-c", done=True, create_model=pb.CreateModelOutput(model_id=run.model_id))
    store.finish_op("req-c", result, 103.0, release_key=True)
    assert store.add_op(op("req-1", 1, run.model_id), run) == "req-1"

    loaded = ControlStore(StoreConfig(db_url)).load()
    assert [(x.session_id, x.tenant, x.user_metadata, x.next_model, x.next_sampler, x.finished)
            for x in loaded.sessions] == [("s1", "alice", {"who": "me"}, 1, 2, "success")]
    [r] = loaded.runs
    assert (r.model_id, r.tenant, r.base_model, r.lora, r.user_metadata, r.create_request_id, r.created_at,
            r.last_checkpoint, r.last_checkpoint_time) == (
        run.model_id, "alice", "base/x", pb.LoraConfig(rank=8, alpha=16.0, seed=3), {"k": "v"}, "req-c", 100.5,
        "tinker://s1:train:0/weights/a", 102.0)
    assert [(x.sampling_session_id, x.base_model, x.model_path, x.version, x.follows) for x in loaded.sampling] == [
        ("s1:sample:1", "base/x", "tinker://p", 7.5, ""), ("s1:sample:2", "base/x", "tinker://q", 8.5, run.model_id)]
    assert [(p.request_id, p.seq_id, p.state) for p in loaded.pending] == [("req-1", 1, "pending")]
    done = store.get_op("req-c")
    assert done is not None and done.state == "done" and pb.FutureResult.FromString(done.result) == result
    store.delete_run(run.model_id)
    assert store.load().runs == []


def test_a_seq_id_names_one_request_until_its_result_goes(db_url: str) -> None:
    store = ControlStore(StoreConfig(db_url, keep_done=2))
    assert store.add_op(op("req-a", 1)) == "req-a"
    assert store.add_op(op("req-b", 1)) == "req-a"  # the database decides, not a process's memory
    assert store.add_op(op("req-c", 1, key="other")) == "req-c"
    assert store.add_op(op("req-n1", None)) == "req-n1" and store.add_op(op("req-n2", None)) == "req-n2"
    with pytest.raises(sa.exc.IntegrityError):
        store.add_op(op("req-a", 2))  # a request id is recorded once
    # a submit that failed on its way in releases its seq_id: the retry is a new request
    store.finish_op("req-a", pb.FutureResult(error=pb.Error(code="ResourceExhausted")), 10.0, release_key=True)
    assert store.add_op(op("req-d", 1)) == "req-d"
    # results are kept at most keep_done (oldest first) and for retention_s; the seq_id goes with its result
    for rid, t in (("req-d", 20.0), ("req-c", 30.0), ("req-n1", 40.0)):
        store.finish_op(rid, pb.FutureResult(), t, release_key=False)
    assert store.add_op(op("req-e", 1)) == "req-d"
    assert store.purge(now=41.0) == 2  # req-a and req-d: over keep_done = 2
    assert store.get_op("req-d") is None and store.get_op("req-c") is not None
    assert store.add_op(op("req-e", 1)) == "req-e"
    assert store.purge(now=40.0 + store.cfg.retention_s) == 1  # req-c is past the retention, req-n1 not yet
    assert store.get_op("req-c") is None and store.get_op("req-n1") is not None
    assert {p.request_id for p in store.load().pending} == {"req-n2", "req-e"}  # pending ones never expire


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(tmp_path: Path) -> None:
    store = ControlStore(StoreConfig(f"sqlite:///{tmp_path}/c.db", busy_timeout_ms=1234))
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
    other = sqlite3.connect(tmp_path / "c.db")  # another process's writer holds the lock for a moment...
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO sessions (session_id, tenant, user_metadata, next_model, next_sampler, finished) "
                  "VALUES ('x', 't', '{}', 0, 0, '')")
    with pytest.raises(sa.exc.OperationalError, match="database is locked"):
        store.put_session(Session("y", "t", {}))  # ... past the busy timeout: a clear error, never corruption
    other.commit()
    store.put_session(Session("y", "t", {}))
    assert sorted(s.session_id for s in store.load().sessions) == ["x", "y"]


def test_a_restarted_core_finds_everything_and_reruns_what_was_pending(tmp_path: Path) -> None:
    """Core A records a session, a run, a finished and a pending operation, and "dies"; core B over the same file
    answers the finished one from the ledger, re-sends the pending one, and gives a repeat its first id."""
    url = f"sqlite:///{tmp_path}/c.db"
    sent: list[int] = []

    async def work(run: Run, top: pb.TrainerOp) -> pb.FutureResult:
        sent.append(top.seq_id)
        if top.seq_id == 2:
            await asyncio.Event().wait()  # still running when A dies
        return pb.FutureResult(optim_step=pb.OptimStepOutput(metrics={"seq": float(top.seq_id)}))

    adam = {"optim_step": pb.OptimStepRequest(adam_params=pb.AdamParams(beta1=0.9, beta2=0.95, eps=1e-8))}

    async def before() -> tuple[str, str, str]:
        a = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)))
        sid = a.book.create("t", {})
        run = Run(f"{sid}:train:0", "t", sid, "base", pb.LoraConfig(rank=4), {})
        a.store.put_run(run, op("req-create", None, run.model_id, "create_model"))
        a.store.finish_op("req-create", pb.FutureResult(), 1.0, release_key=True)
        run.ready.set()
        a.runs.by_id[run.model_id] = run
        one = a.runs.submit_op("t", run.model_id, 1, adam, work).request_id
        two = a.runs.submit_op("t", run.model_id, 2, adam, work).request_id
        assert (await a.ledger.retrieve("t", one, 5.0)).optim_step.metrics["seq"] == 1.0
        for t in a.ledger._tasks:
            t.cancel()
        return run.model_id, one, two

    model_id, one, two = asyncio.run(before())

    async def after() -> None:
        b = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)))
        b.runs._run_op = work  # the trainer, as far as this test is concerned
        assert b.restore() == 1
        assert b.runs.by_id[model_id].ready.is_set()
        assert b.runs.submit_op("t", model_id, 2, adam, work).request_id == two
        assert (await b.ledger.retrieve("t", one, 5.0)).optim_step.metrics["seq"] == 1.0  # from the ledger
        assert (await b.ledger.retrieve("t", two, 0.2)).done is False
        assert sent[-1] == 2 and sent.count(2) == 2  # sent once by A, once again by B
        for t in b.ledger._tasks:
            t.cancel()

    asyncio.run(after())


def test_session_numbers_come_from_the_database_and_never_go_back(db_url: str) -> None:
    a, b = ControlStore(StoreConfig(db_url)), ControlStore(StoreConfig(db_url))  # two gateways over one database
    a.put_session(Session("s", "t", {}))
    assert [a.number("s", "next_model", None), b.number("s", "next_model", None)] == [0, 1]
    assert b.number("s", "next_model", 7) == 7  # a client's own number (Tinker's SDK sends one)
    assert a.number("s", "next_model", 3) == 3  # a lower one leaves the counter where it is
    assert a.number("s", "next_model", None) == 8
    assert b.get_session("s").next_model == 9 and b.get_session("nope") is None
    a.close()
    b.close()


def test_a_second_gateway_adopts_what_the_first_made_and_waits_for_its_results(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    release = asyncio.Event()

    async def slow(run: Run, top: pb.TrainerOp) -> pb.FutureResult:
        await release.wait()
        return pb.FutureResult(optim_step=pb.OptimStepOutput(metrics={"seq": float(top.seq_id)}))

    adam = {"optim_step": pb.OptimStepRequest(adam_params=pb.AdamParams(beta1=0.9, beta2=0.95, eps=1e-8))}

    async def both() -> None:
        a = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)))
        b = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)))
        sid = a.book.create("t", {})
        run = Run(f"{sid}:train:0", "t", sid, "base", pb.LoraConfig(rank=4), {}, create_request_id="req-create")
        a.store.put_run(run, op("req-create", None, run.model_id, "create_model"))
        a.store.finish_op("req-create", pb.FutureResult(), 1.0, release_key=True)
        one = a.runs.submit_op("t", run.model_id, 1, adam, slow).request_id
        adopted = b.runs.get("t", run.model_id)  # made by A: B finds it in the database, ready
        assert adopted.ready.is_set() and b.book.get("t", sid).tenant == "t"
        with pytest.raises(NotFound):
            b.runs.get("someone-else", run.model_id)
        assert b.runs.submit_op("t", run.model_id, 1, adam, slow).request_id == one  # the database names the holder
        waiting = asyncio.create_task(b.ledger.retrieve("t", one, 10.0))  # pending at A: B holds the poll
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release.set()
        assert (await waiting).optim_step.metrics["seq"] == 1.0
        for core in (a, b):
            for t in core.ledger._tasks:
                t.cancel()

    asyncio.run(both())


def test_idempotent_internal_calls_wait_for_a_restarting_service_and_give_up_clearly() -> None:
    class Flaky:
        def __init__(self, failures: int) -> None:
            self.failures, self.calls = failures, 0

        async def __call__(self, request: str, timeout: float) -> str:
            self.calls += 1
            assert timeout == 7.0
            if self.calls <= self.failures:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="connect failed: 127.0.0.1:9")
            return f"ok {request}"

    caller = Caller(CallPolicy(retry_first_s=0.001, retry_max_s=0.004, retry_budget_s=0.05))

    async def scenario() -> None:
        back = Flaky(failures=3)
        assert await caller.call(back, "x", deadline_s=7.0, idempotent=True) == "ok x" and back.calls == 4
        once = Flaky(failures=1)
        with pytest.raises(Unavailable, match="connect failed: 127.0.0.1:9"):
            await caller.call(once, "x", deadline_s=7.0, idempotent=False)
        assert once.calls == 1
        gone = Flaky(failures=10**9)
        with pytest.raises(Unavailable, match=r"unavailable for 0 s \(last error: connect failed: 127.0.0.1:9\)"):
            await caller.call(gone, "x", deadline_s=7.0, idempotent=True)
        assert 5 <= gone.calls < 100

    asyncio.run(scenario())


def test_a_submit_refused_on_its_way_in_leaves_its_seq_id_free_in_the_ledger(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/c.db"

    async def scenario() -> None:
        core = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)))
        run = Run("m", "t", "s", "base", pb.LoraConfig(rank=4), {})
        run.ready.set()
        core.runs.by_id["m"] = run
        refuse = True

        async def work(run: Run, top: pb.TrainerOp) -> pb.FutureResult:
            if refuse:
                raise ResourceExhausted("trainer queue is full", retry_after_s=1.0)
            return pb.FutureResult(optim_step=pb.OptimStepOutput())

        step = {"optim_step": pb.OptimStepRequest(adam_params=pb.AdamParams(beta1=0.9, beta2=0.95, eps=1e-8))}
        first = core.runs.submit_op("t", "m", 1, step, work).request_id
        assert (await core.ledger.retrieve("t", first, 5.0)).error.code == "ResourceExhausted"
        recorded = core.store.get_op(first)
        assert recorded is not None and recorded.seq_id is None and recorded.state == "done"
        refuse = False
        # a restarted core (nothing in memory) runs the retry too: the ledger does not hold the seq_id either
        again = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)))
        again.runs.by_id["m"] = run
        retry = again.runs.submit_op("t", "m", 1, step, work).request_id
        assert retry != first
        assert (await again.ledger.retrieve("t", retry, 5.0)).HasField("optim_step")

    asyncio.run(scenario())
