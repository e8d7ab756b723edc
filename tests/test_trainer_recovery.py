"""Recovery snapshots in-process: a second trainer rebuilds a run from the first one's snapshot plus the
operations after it, and ends with the weights of an uninterrupted run, bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lathe.checkpoints.service import CheckpointService
from lathe.checkpoints.store import open_store
from lathe.errors import NotFound
from lathe.models.catalog import ModelCatalog
from lathe.trainer.answers import Answers
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.ops import OptimStep
from lathe.trainer.recovery import SnapshotPolicy
from lathe.types import AdamParams, recovery_path
from lathe.v1 import lathe_pb2 as pb
from tests.test_trainer_engine import BASE, batch, fb, opt, submit, weights

LORA = pb.LoraConfig(rank=4, train_attn=True, train_mlp=True, train_unembed=True)  # seeded by the model id


class ServiceStore:
    """The engine's ``CheckpointStore`` over an in-process checkpoints service (the gRPC client's twin)."""

    def __init__(self, root: Path) -> None:
        self.service = CheckpointService(open_store(root))

    def put(self, **kw: object) -> str:
        return self.service.put(**kw).path

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]:
        return self.service.get(tenant, path)[1]


def trainer(model_cache: Path, store: ServiceStore, every: int = 2) -> TrainerEngine:
    policy = SnapshotPolicy(every_steps=every, stagger=False)
    eng = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache, snapshots=policy),
                        ModelCatalog.from_spec(BASE, model_cache), store)
    eng.start()
    return eng


def save(seq: int) -> pb.TrainerOp:
    return pb.TrainerOp(model_id="m", seq_id=seq, tenant="t", request_id=f"r{seq}",
                        save=pb.SaveRequest(model_id="m", seq_id=seq, name=f"s{seq}", kind="weights"))


# fb, opt, fb, opt, fb, save(weights: a snapshot with a gradient pending), opt, fb, opt
OPS = [fb("m", 1, batch(1)), opt("m", 2), fb("m", 3, batch(2)), opt("m", 4), fb("m", 5, batch(3)), save(6),
       opt("m", 7), fb("m", 8, batch(4)), opt("m", 9)]


def run(eng: TrainerEngine, ops: list[pb.TrainerOp]) -> list[pb.TrainerResult]:
    out = []
    for op in ops:
        res = submit(eng, op).result(timeout=120)
        assert res.WhichOneof("result") != "error", res.error.message
        out.append(res)
    return out


@pytest.fixture()
def store(tmp_path: Path) -> ServiceStore:
    return ServiceStore(tmp_path / "store")


@pytest.mark.parametrize("crash_after", [0, 3, 5, 6, 7])
def test_a_run_rebuilt_from_its_snapshot_and_the_ops_after_it_equals_the_uninterrupted_run(
        model_cache: Path, tiny_dir: Path, tmp_path: Path, store: ServiceStore, crash_after: int) -> None:
    whole = trainer(model_cache, ServiceStore(tmp_path / "uninterrupted"))
    whole.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=LORA))
    reference = run(whole, OPS)
    expected = weights(whole, "m")
    whole.stop()

    first = trainer(model_cache, store)
    first.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=LORA))
    receipts = [r.receipt for r in run(first, OPS[:crash_after])]
    first.stop()  # the crash: everything in memory is gone
    snapshots = [r for r in receipts if r.recovery_path]
    # every 2nd optim_step (seq 4) and the training-state save (seq 6) wrote one
    assert [r.recovery_seq_id for r in snapshots] == [s for s in (4, 6) if s <= crash_after]

    second = trainer(model_cache, store)
    info = second.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=LORA,
                                                         recover_from=recovery_path("m")))
    assert info.next_seq_id == (snapshots[-1].recovery_seq_id if snapshots else 0) + 1
    replayed = run(second, [op for op in OPS if op.seq_id >= info.next_seq_id])
    got = weights(second, "m")
    second.stop()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # the replayed forward_backward results are the originals, bit for bit
    for res in replayed:
        if res.HasField("forward_backward"):
            ref = reference[res.receipt.seq_id - 1].forward_backward
            assert res.forward_backward.loss_fn_outputs == ref.loss_fn_outputs


def test_snapshots_are_the_tenants_own_and_never_listed(model_cache: Path, tiny_dir: Path,
                                                        store: ServiceStore) -> None:
    eng = trainer(model_cache, store, every=1)
    eng.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=LORA))
    path = run(eng, OPS[:2])[1].receipt.recovery_path
    eng.stop()
    assert path == recovery_path("m") == "tinker://m/recovery/latest"
    assert store.service.list("t").checkpoints == []  # internal: not among the user's checkpoints
    with pytest.raises(NotFound):
        store.service.get("someone-else", path)


def test_a_run_started_from_a_saved_state_is_recovered_from_that_state(model_cache: Path, tiny_dir: Path,
                                                                         store: ServiceStore) -> None:
    first = trainer(model_cache, store, every=0)
    first.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=LORA))
    saved = run(first, OPS[:6])[-1].save.path  # a training state after two steps, with a gradient pending
    first.create_adapter(pb.CreateAdapterRequest(model_id="resumed", tenant="t", from_path=saved, with_optimizer=True))
    expected = weights(first, "resumed")
    first.stop()
    second = trainer(model_cache, store, every=0)
    info = second.create_adapter(pb.CreateAdapterRequest(model_id="resumed", tenant="t", base_model=BASE,
                                                         lora_config=LORA, recover_from=recovery_path("resumed")))
    got = weights(second, "resumed")
    second.stop()
    assert info.next_seq_id == 1 and info.step == 2
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_runs_stepping_together_write_their_snapshots_after_different_steps() -> None:
    """Eight runs that step in the same cycles: each still snapshots every 10th step, but not all after the same
    one (a burst of eight ~70 MB writes held a whole pool); without ``stagger``, at multiples of 10."""
    runs = [f"sess-{k}:train:0" for k in range(8)]

    def due_steps(policy: SnapshotPolicy, run_id: str) -> list[int]:
        return [s for s in range(1, 31) if policy.due(OptimStep(AdamParams()), s, 1, run_id)]

    staggered = {r: due_steps(SnapshotPolicy(every_steps=10), r) for r in runs}
    for steps in staggered.values():
        assert len(steps) == 3 and steps[1] - steps[0] == steps[2] - steps[1] == 10
    assert len({steps[0] for steps in staggered.values()}) >= 4
    assert {r: due_steps(SnapshotPolicy(every_steps=10, stagger=False), r) for r in runs} == {
        r: [10, 20, 30] for r in runs}


class GatedStore(ServiceStore):
    """A checkpoints service whose recovery writes for one run wait until ``gate`` opens."""

    def __init__(self, root: Path, run_id: str) -> None:
        super().__init__(root)
        self.run_id, self.gate, self.waiting = run_id, threading.Event(), threading.Event()

    def put(self, **kw: object) -> str:
        if kw["run_id"] == self.run_id and kw["kind"] == "recovery" and kw["files"].get("adapter_model.safetensors"):
            self.waiting.set()
            assert self.gate.wait(timeout=120)
        return super().put(**kw)


def test_snapshot_writers_run_no_aten_op(model_cache: Path, store: ServiceStore, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """A snapshot is serialized on the cycle thread; the writer threads only store bytes. A writer that copied
    tensors itself would enter ATen's parallel regions and keep an OpenMP team of its own, and more workers than
    CPUs slow every later cycle's parallel ops (``RunMaker.take_snapshot``)."""
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Callable[..., object], types: object, args: tuple = (),
                               kwargs: dict | None = None) -> object:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    drain = Answers._drain

    def recorded(self: Answers, run_id: str) -> None:
        with Record():  # dispatch modes are per thread: this sees the writer's ops only
            drain(self, run_id)

    monkeypatch.setattr(Answers, "_drain", recorded)
    eng = trainer(model_cache, store, every=1)
    try:
        eng.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=LORA))
        answers = run(eng, [fb("m", 1, batch(1)), opt("m", 2), fb("m", 3, batch(2)), opt("m", 4)])
    finally:
        eng.stop()
    assert [r.receipt.recovery_seq_id for r in answers] == [0, 2, 0, 4]  # two snapshots, each through a writer
    assert store.service.get("t", recovery_path("m"))[1]["adapter_model.safetensors"]
    assert seen == []


def test_a_slow_snapshot_write_holds_its_own_runs_answers_and_no_one_elses(model_cache: Path, tmp_path: Path) -> None:
    """The write runs beside the cycles: while run 'slow''s snapshot after its optim_step hangs in the store, run
    'fast' keeps stepping (snapshots included) and 'slow''s next forward_backward is computed, but 'slow''s
    answers leave only once the write is done, in order, the first naming the snapshot."""
    store = GatedStore(tmp_path / "store", "slow")
    eng = trainer(model_cache, store, every=1)
    try:
        for run_id in ("slow", "fast"):
            eng.create_adapter(pb.CreateAdapterRequest(model_id=run_id, tenant="t", base_model=BASE, lora_config=LORA))
        held = [submit(eng, op) for op in (fb("slow", 1, batch(1)), opt("slow", 2), fb("slow", 3, batch(2)))]
        assert store.waiting.wait(timeout=120)
        fast = run(eng, [fb("fast", 1, batch(3)), opt("fast", 2), fb("fast", 3, batch(4)), opt("fast", 4)])
        assert [r.receipt.recovery_seq_id for r in fast] == [0, 2, 0, 4]
        assert held[0].done() and not held[1].done() and not held[2].done()
        done_order: list[int] = []
        for k, f in enumerate(held[1:], start=2):
            f.add_done_callback(lambda _, k=k: done_order.append(k))
        store.gate.set()
        answers = [f.result(timeout=120) for f in held]
        assert done_order == [2, 3]
        assert [r.receipt.recovery_seq_id for r in answers] == [0, 2, 0]
        assert answers[2].receipt.cycle > answers[1].receipt.cycle  # computed while the write was waiting
    finally:
        store.gate.set()
        eng.stop()


def test_the_next_cycle_waits_for_a_run_whose_answer_waits_on_its_snapshot_write(model_cache: Path,
                                                                               tmp_path: Path) -> None:
    """Two runs stepping in lock step: while 'slow''s answer waits for its snapshot write, 'fast''s next step is
    not run without it (that would cost a second pass every round a run writes one); once the write is done and
    'slow' sends its next step, both share a cycle again."""
    store = GatedStore(tmp_path / "store", "slow")
    cfg = TrainerConfig(models=BASE, cache_root=model_cache, rejoin_write_max_s=60.0,
                        snapshots=SnapshotPolicy(every_steps=1, stagger=False))
    eng = TrainerEngine(cfg, ModelCatalog.from_spec(BASE, model_cache), store)
    held_back = threading.Event()  # set when the cycle thread decides to wait for a run's snapshot write
    awaiting_write = eng.window.awaiting_write

    def spy() -> bool:
        waits = awaiting_write()
        if waits:
            held_back.set()
        return waits

    eng.window.awaiting_write = spy
    eng.start()
    try:
        for run_id in ("slow", "fast"):
            eng.create_adapter(pb.CreateAdapterRequest(model_id=run_id, tenant="t", base_model=BASE, lora_config=LORA))
        first = {r: [submit(eng, fb(r, 1, batch(1))), submit(eng, opt(r, 2))] for r in ("slow", "fast")}
        assert store.waiting.wait(timeout=120)
        assert first["fast"][1].result(timeout=120).receipt.cycle == first["slow"][0].result(timeout=120).receipt.cycle
        fast_next = [submit(eng, fb("fast", 3, batch(2))), submit(eng, opt("fast", 4))]
        assert held_back.wait(timeout=120)
        assert not fast_next[0].done()  # waiting for 'slow' (up to rejoin_write_max_s, 60 s, while the gate is shut)
        store.gate.set()
        assert first["slow"][1].result(timeout=120).receipt.recovery_seq_id == 2
        slow_next = [submit(eng, fb("slow", 3, batch(3))), submit(eng, opt("slow", 4))]
        cycles = {f.result(timeout=120).receipt.cycle for f in fast_next + slow_next}
        assert len(cycles) == 1
    finally:
        store.gate.set()
        eng.stop()
