"""Recovery that never lies (issue 22: M1, M2, M4, M7), in-process: a trainer that stops after writing a snapshot
and before its answers reach the gateway answers those operations from the snapshot, as applied, and never
applies them twice; a run whose snapshot is missing is refused with an error naming it, never rebuilt from a fresh
adapter; a second rebuild of a run already live answers its live state; a run that never steps is snapshotted
too. One trainer applies every run's operations and stops; a second, over the same checkpoint store, is the
restarted one each test rebuilds its own run on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lathe.errors import FailedPrecondition, NotFound
from lathe.gateway.core import GatewayCore
from lathe.gateway.records import Operation, Run
from lathe.models.catalog import ModelCatalog
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.recovery import SnapshotPolicy
from lathe.types import recovery_path
from lathe.v1 import lathe_pb2 as pb
from tests.test_trainer_engine import BASE, batch, fb, opt, submit, weights
from tests.test_trainer_recovery import LORA, OPS, ServiceStore, run


def forward(seq: int) -> pb.TrainerOp:
    op = fb("fwd", seq, batch(seq))
    op.forward_backward.forward_only = True
    return op


POLICY = SnapshotPolicy(every_steps=2, every_ops=5, stagger=False)
FORWARDS = [forward(s) for s in range(1, 8)]  # a run that never steps


def of(model_id: str, ops: list[pb.TrainerOp]) -> list[pb.TrainerOp]:
    """``ops`` sent to run ``model_id`` instead."""
    out = []
    for op in ops:
        moved = pb.TrainerOp()
        moved.CopyFrom(op)
        moved.model_id = model_id
        out.append(moved)
    return out


def creation(model_id: str, **kw: object) -> pb.CreateAdapterRequest:
    return pb.CreateAdapterRequest(model_id=model_id, tenant="t", base_model=BASE, lora_config=LORA, **kw)


def rebuild(model_id: str) -> pb.CreateAdapterRequest:
    """What the gateway sends a trainer that lost the run (``rebuild.rebuild``)."""
    return creation(model_id, recover_from=recovery_path(model_id))


@dataclass
class Restart:
    store: ServiceStore
    answers: dict[str, list[pb.TrainerResult]]  # run -> the first trainer's answers, which never reached a gateway
    applied: dict[str, dict[str, torch.Tensor]]  # run -> its weights when the first trainer stopped
    trainer: TrainerEngine  # the restarted one


def _engine(store: ServiceStore, model_cache: Path) -> TrainerEngine:
    eng = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache, snapshots=POLICY),
                        ModelCatalog.from_spec(BASE, model_cache), store)
    eng.start()
    return eng


@pytest.fixture(scope="module")
def restart(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Restart]:
    store = ServiceStore(tmp_path_factory.mktemp("recovery-truth"))
    first = _engine(store, model_cache)
    plan = {"m": of("m", OPS[:4]), "gone": of("gone", OPS[:4]), "live": of("live", OPS[:4]),
            "src": of("src", OPS[:6]), "fwd": FORWARDS}  # OPS[:4]: 2 steps, a snapshot after seq 4
    answers = {}
    for model, ops in plan.items():
        first.create_adapter(creation(model))
        answers[model] = run(first, ops)
    first.create_adapter(pb.CreateAdapterRequest(model_id="resumed", tenant="t", from_path=answers["src"][-1].save.path,
                                                 with_optimizer=True))
    applied = {model: weights(first, model) for model in plan}
    first.stop()  # the crash: none of these answers reached the gateway
    for model in ("gone", "resumed"):
        store.service.delete("t", recovery_path(model))  # expired or swept
    second = _engine(store, model_cache)
    yield Restart(store, answers, applied, second)
    second.stop()


class EngineStub:
    """The trainer's two methods that a rebuild calls, as the gateway calls them (``stub.Method(request,
    timeout=...)``), over an in-process engine; errors are raised as the gateway's caller raises them."""

    def __init__(self, eng: TrainerEngine) -> None:
        self.eng = eng

    async def CreateAdapter(self, req: pb.CreateAdapterRequest, timeout: float) -> pb.AdapterInfo:
        return await asyncio.to_thread(self.eng.create_adapter, req)

    async def Run(self, op: pb.TrainerOp, timeout: float) -> pb.TrainerResult:
        return await asyncio.wrap_future(await asyncio.to_thread(submit, self.eng, op))


def _gateway(trainer: TrainerEngine, *models: str) -> GatewayCore:
    """A gateway whose trainer is ``trainer`` in-process, holding ``models`` as its runs."""
    core = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1")
    stub = EngineStub(trainer)
    core.router.trainer = lambda base_model, key: stub
    for model in models:
        core.runs.by_id[model] = Run(model, "t", "s", BASE, LORA, {})
        core.runs.by_id[model].ready.set()
    return core


def test_through_the_gateway_applied_steps_are_answered_from_the_snapshot_and_a_lost_run_is_named(
        restart: Restart) -> None:
    """Through the gateway's rebuild: the forward_backward and optim_step applied and snapshotted just before the
    trainer stopped, their answers lost on the way, are sent again and answered as applied (their original
    results), and the weights are those of one application; a run whose snapshot is gone fails its operation
    with FailedPrecondition naming the run and the snapshot, and nothing is created in its place."""
    async def scenario() -> list[pb.FutureResult]:
        core = _gateway(restart.trainer, "m", "gone")
        fb3, opt4 = of("m", OPS[2:4])
        sent = [await core.runs.submit("t", "m", 3, forward_backward=fb3.forward_backward),
                await core.runs.submit("t", "m", 4, optim_step=opt4.optim_step),
                await core.runs.submit("t", "gone", 5, forward_backward=fb3.forward_backward)]
        out = [await core.ledger.retrieve("t", s.request_id, 30.0) for s in sent]
        await core.close()
        return out

    fb_res, opt_res, lost = asyncio.run(scenario())
    original = restart.answers["m"]
    assert fb_res.forward_backward == original[2].forward_backward
    assert opt_res.optim_step == original[3].optim_step
    assert opt_res.receipt.recovery_seq_id == 4  # the gateway learns the snapshot from the recorded answer
    got, applied_once = weights(restart.trainer, "m"), restart.applied["m"]
    assert all(torch.equal(got[k], applied_once[k]) for k in applied_once)
    assert lost.error.code == "FailedPrecondition"
    assert lost.error.message.startswith("run 'gone' cannot be rebuilt on this trainer: its recovery snapshot "
                                         "tinker://gone/recovery/latest is missing")
    with pytest.raises(NotFound):
        restart.trainer.limits("gone")


def test_a_run_from_a_saved_state_whose_snapshot_is_missing_is_refused_not_made_fresh(restart: Restart) -> None:
    with pytest.raises(FailedPrecondition, match=r"^run 'resumed' cannot be rebuilt on this trainer: its recovery "
                                                 r"snapshot tinker://resumed/recovery/latest is missing"):
        restart.trainer.create_adapter(rebuild("resumed"))
    with pytest.raises(NotFound):
        restart.trainer.limits("resumed")


def test_a_second_rebuild_of_a_live_run_answers_its_live_state(restart: Restart) -> None:
    """Two gateways that found the run gone both rebuild it: the second (or one that read the snapshot before the
    first was live) gets the run as it is now, its next seq_id included, and changes nothing."""
    eng = restart.trainer
    snapshot = restart.store.get(tenant="t", path=recovery_path("live"))
    assert eng.create_adapter(rebuild("live")).next_seq_id == 5
    run(eng, of("live", OPS[4:6]))  # the first gateway's run goes on: fb 5, save 6
    live = weights(eng, "live")
    again = eng.create_adapter(rebuild("live"))
    late = eng.runs.make(rebuild("live"), snapshot, None)
    assert (again.next_seq_id, again.step) == (late.next_seq_id, late.step) == (7, 2)
    assert all(torch.equal(v, live[k]) for k, v in weights(eng, "live").items())
    assert run(eng, of("live", OPS[6:7]))[0].receipt.seq_id == 7


def test_a_run_that_never_steps_is_snapshotted_every_few_seq_ids(restart: Restart) -> None:
    """A forward-only run gets a snapshot every ``every_ops`` seq_ids, so the gateway's ledger lets go of the
    operations before it (``ControlStore.purge`` keeps those after the run's snapshot) and a rebuild replays few;
    repeats of the seq_ids up to that snapshot are answered from it."""
    original = restart.answers["fwd"]
    assert [r.receipt.recovery_seq_id for r in original] == [0, 0, 0, 0, 5, 0, 0]
    assert restart.trainer.create_adapter(rebuild("fwd")).next_seq_id == 6
    assert [submit(restart.trainer, op).result(timeout=60) for op in FORWARDS[:5]] == original[:5]



def _save(model_id: str, seq: int, kind: str) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", request_id=f"{model_id}-{seq}",
                        save=pb.SaveRequest(model_id=model_id, seq_id=seq, name=f"{kind}-{seq}", kind=kind))


def _load(model_id: str, seq: int, path: str) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", request_id=f"{model_id}-{seq}",
                        load=pb.LoadRequest(model_id=model_id, seq_id=seq, path=path, with_optimizer=True))


def _rebuilt_by_the_gateway(trainer: TrainerEngine, model: str, logged: list[pb.TrainerOp],
                            next_op: pb.TrainerOp) -> pb.FutureResult:
    """A gateway whose ledger holds ``logged``, all answered without error, sends ``next_op`` to ``trainer``,
    which lost the run: the answer, once the gateway has rebuilt the run there (``rebuild.rebuild``)."""
    async def scenario() -> pb.FutureResult:
        core = _gateway(trainer, model)
        for op in logged:
            rid = f"{model}-{op.seq_id}"
            core.store.add_op(Operation(rid, "t", model, op.seq_id, op.WhichOneof("op"), op.SerializeToString()))
            core.store.finish_op(rid, pb.FutureResult(), 0.0, release_key=False)
        kind = next_op.WhichOneof("op")
        sent = await core.runs.submit("t", model, next_op.seq_id, **{kind: getattr(next_op, kind)})
        out = await core.ledger.retrieve("t", sent.request_id, 60.0)
        await core.close()
        return out

    return asyncio.run(scenario())


def test_a_rebuild_neither_saves_again_nor_reads_a_load_again(tmp_path: Path, model_cache: Path,
                                                               tiny_dir: Path) -> None:
    """A load is snapshotted, so a rebuild never reads the checkpoint it loaded (overwritten or deleted since); an
    answered save is not run again by a replay (it changed no state and its answer stands), so a sampler
    checkpoint the user deleted since stays deleted; and the rebuilt run is the one the first trainer left."""
    store = ServiceStore(tmp_path / "store")
    first = _engine(store, model_cache)
    first.create_adapter(creation("ld"))
    state = run(first, [_save("ld", 1, "weights")])[0].save.path
    assert run(first, [_load("ld", 2, state)])[0].receipt.recovery_seq_id == 2  # the load was snapshotted
    first.create_adapter(creation("sv"))
    logged = [fb("sv", 1, batch(1)), opt("sv", 2), _save("sv", 3, "sampler_weights"), fb("sv", 4, batch(2))]
    answers = run(first, logged)
    assert [r.receipt.recovery_seq_id for r in answers] == [0, 0, 0, 0]
    applied = weights(first, "sv")
    first.stop()
    store.service.delete("t", state)
    store.service.delete("t", answers[2].save.path)
    second = _engine(store, model_cache)
    try:
        assert second.create_adapter(rebuild("ld")).next_seq_id == 3  # the load is not replayed
        out = _rebuilt_by_the_gateway(second, "sv", logged, fb("sv", 5, batch(3)))
        assert out.WhichOneof("result") == "forward_backward", out.error
        with pytest.raises(NotFound):
            store.service.get("t", answers[2].save.path)  # not brought back by the replay
        assert all(torch.equal(v, applied[k]) for k, v in weights(second, "sv").items())
    finally:
        second.stop()


def test_a_replayed_operation_that_fails_now_fails_the_rebuild_naming_it(
        tmp_path: Path, model_cache: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose snapshot could not be written is replayed by a rebuild; if its checkpoint is gone by then, the
    rebuild fails with FailedPrecondition naming the run and the load, never a run that skipped it."""
    store = ServiceStore(tmp_path / "store")
    first = _engine(store, model_cache)
    first.create_adapter(creation("bad"))
    state = run(first, [_save("bad", 1, "weights")])[0].save.path  # snapshotted at 1

    def unwritable(*args: object) -> None:
        raise OSError("store down")

    monkeypatch.setattr(first.maker, "write_snapshot", unwritable)
    assert run(first, [_load("bad", 2, state)])[0].receipt.recovery_seq_id == 0  # applied, snapshot skipped
    first.stop()
    store.service.delete("t", state)
    second = _engine(store, model_cache)
    try:
        out = _rebuilt_by_the_gateway(second, "bad", [_save("bad", 1, "weights"), _load("bad", 2, state)],
                                      fb("bad", 3, batch(1)))
        assert out.error.code == "FailedPrecondition", out
        assert out.error.message.startswith("run 'bad' cannot be rebuilt as it was: replaying its load of seq_id 2, "
                                            "which succeeded, failed now (NotFound: ")
    finally:
        second.stop()
