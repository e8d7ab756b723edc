"""A trainer pool's training runs: ``Run``, a run as the cycle scheduler sees it, and ``Runs``, which makes them and
writes their recovery snapshots.

    Run    model_id, tenant, its ordered queue (``order.Sequencer``), its forward / forward_backward in progress
           over one or more cycles (an ``order.Request`` taken off that queue), and which seq_id its latest
           recovery snapshot was taken (and last tried) after
    Runs   the runs by model_id; ``create`` (a caller's CreateAdapterRequest) and ``make`` (the same on every rank of
           a pool, from a plan) build a run fresh, from a saved state or from its recovery snapshot; ``snapshot``
           copies a run's state when one is due and returns its write; ``take_creates`` hands a pool's leader the
           runs made since its last plan

Who owns what: ``Runs`` owns the ``Run`` records, under the engine's lock (handed in: the engine's queues, its cycle
and the runs share one lock); the adapters themselves live in the ``AdapterBank`` (shared with the engine, which
pages them), and are made, read and snapshotted by ``lifecycle.RunMaker``. A run's answers are the engine's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from lathe.errors import FailedPrecondition, LatheError, ResourceExhausted
from lathe.trainer.bank import AdapterBank
from lathe.trainer.config import TrainerConfig
from lathe.trainer.lifecycle import RunMaker
from lathe.trainer.ops import Result
from lathe.trainer.order import Request, Sequencer
from lathe.trainer.plan import Create, Files
from lathe.trainer.recovery import Record
from lathe.types import recovery_path
from lathe.v1 import lathe_pb2 as pb

log = logging.getLogger("lathe.trainer")


@dataclass(slots=True)
class Run:
    """A training run as the scheduler sees it; its adapter lives in the bank."""

    model_id: str
    tenant: str
    seq: Sequencer = field(default_factory=Sequencer)
    current: Request | None = None  # its forward / forward_backward in progress
    snapshot_seq: int = 0  # the seq_id its latest recovery snapshot was taken after
    snapshot_tried: int = 0  # the seq_id after which one was last due, written or not (``SnapshotPolicy.every_ops``)

    @property
    def ready(self) -> bool:
        """Has it work for the next cycle (a request part-way through, or an operation at its queue's head)?"""
        return self.current is not None or self.seq.peek() is not None


class Runs:
    """The runs of one trainer (``models``, by model_id), guarded by ``lock``. ``writes``: this process writes
    snapshots (a pool's followers never do); ``leader``: it sends the runs it makes to its followers;
    ``evict``: called (lock held) after a run's adapter joined the bank."""

    def __init__(self, cfg: TrainerConfig, maker: RunMaker, bank: AdapterBank, lock: threading.Condition, *,
                 writes: bool, leader: bool, evict: Callable[[], None]) -> None:
        self.cfg, self.maker, self.bank, self.lock = cfg, maker, bank, lock
        self.writes, self.leader, self.evict = writes, leader, evict
        self.models: dict[str, Run] = {}
        self._creates: list[Create] = []  # runs made since the last plan went out (a pool's leader only)

    def create(self, req: pb.CreateAdapterRequest) -> pb.AdapterInfo:
        """``TrainerEngine.create_adapter``'s work, on a passing thread: the run as it is here if it exists, else
        made from its recovery snapshot (``req.recover_from``), the state it starts from (``req.from_path``), or
        fresh."""
        with self.lock:
            live = self.live(req.model_id)
        if live is not None:
            return live
        snapshot = self.maker.snapshot_files(req) if req.recover_from else None
        state = None
        if snapshot is None and req.from_path:
            state = self.maker.store().get(tenant=req.tenant, path=req.from_path)
        return self.make(req, snapshot, state)

    def make(self, req: pb.CreateAdapterRequest, snapshot: Files | None, state: Files | None) -> pb.AdapterInfo:
        """Build run ``req.model_id`` from its recovery ``snapshot``, else the training ``state`` it starts from,
        else fresh; the same on every rank of a pool (the leader puts it in the followers' next plan). A new run's
        first snapshot is written before it exists here (its creation fails if it cannot be): the state it starts
        from, or a fresh run's record alone. A run that exists already is answered as it is."""
        record = Record.read(snapshot) if snapshot is not None else Record(0, state=state is not None)
        if snapshot is not None and record.state:  # a recovery: the run as its snapshot left it
            adapter = self.maker.from_snapshot(req, snapshot)
        elif state is not None:
            adapter = self.maker.from_state(req, state)
        else:
            adapter = self.maker.fresh(req)
        if snapshot is None and self.writes:  # recovery never depends on anything else
            self.maker.write_snapshot(self.maker.take_snapshot(adapter, state=record.state), record)
        with self.lock:
            live = self.live(req.model_id)
            if live is not None:
                return live
            seq = Sequencer.after(record.seq_id, record.answers)
            self.models[req.model_id] = Run(req.model_id, req.tenant, seq, snapshot_seq=record.seq_id,
                                            snapshot_tried=record.seq_id)
            self.bank.limit_tenant(req.tenant, req.max_resident_adapters)  # the tenant's quota, from the gateway
            self.bank.add(adapter)
            info = self.live(req.model_id)
            self.evict()
            if self.leader:
                self._creates.append(Create(req.SerializeToString(), snapshot, state))
            return info

    def live(self, model_id: str) -> pb.AdapterInfo | None:
        """Run ``model_id`` as it is here, with the seq_id it expects next; None if it is not here (caller holds
        the lock)."""
        m = self.models.get(model_id)
        if m is None:
            return None
        info = self.maker.info(self.bank.get(model_id))
        info.next_seq_id = m.seq.next_seq
        return info

    # ---- their queues (caller holds the lock) ----

    def admit(self, tenant: str) -> None:
        """Refuse one more waiting operation of ``tenant`` when its share or the whole queue is full."""
        queued = mine = 0
        for x in self.models.values():
            queued += len(x.seq)
            mine += len(x.seq) if x.tenant == tenant else 0
        if mine >= self.cfg.max_queue_per_tenant:
            raise ResourceExhausted(f"this tenant has {mine} operations waiting in the trainer queue, its limit "
                                    f"of {self.cfg.max_queue_per_tenant}; wait for results before sending more",
                                    retry_after_s=1.0)
        if queued >= self.cfg.max_queue:
            raise ResourceExhausted(f"trainer queue is full ({queued} operations waiting); retry later",
                                    retry_after_s=1.0)

    def expire(self, now: float, fail: Callable[[Request, LatheError], None]) -> float | None:
        """``fail`` the operations that waited ``order_wait_s`` for a seq_id that has not arrived. Returns the
        seconds until the next run would reach that wait (None: no run waits for one)."""
        soonest = None
        for m in self.models.values():
            since = m.seq.stalled_since()
            if since is None:
                continue
            left = since + self.cfg.order_wait_s - now
            if left > 0:
                soonest = left if soonest is None else min(soonest, left)
                continue
            for item, reason in m.seq.give_up(now):
                fail(item, FailedPrecondition(reason))
        return soonest

    def ready(self) -> bool:
        """Whether any run has work for the next cycle."""
        return any(m.ready for m in self.models.values())

    def in_progress(self) -> set[str]:
        """The runs with a request part-way through (their adapters stay resident)."""
        return {m.model_id for m in self.models.values() if m.current is not None}

    def drain(self) -> list[Request]:
        """Every queued operation and request in progress, taken off their runs (to be answered with an error)."""
        items = [m.current for m in self.models.values() if m.current is not None]
        for m in self.models.values():
            m.current = None
            items += m.seq.waiting.values()
            m.seq.waiting.clear()
        return items

    def take_creates(self) -> list[Create]:
        """The runs made since the last call, for a leader's next plan (caller holds the lock)."""
        creates, self._creates = self._creates, []
        return creates

    def snapshot(self, m: Run, item: Request, result: Result) -> Callable[[], None] | None:
        """The write of ``m``'s recovery snapshot if one is due after ``item`` (applied with ``result``, its receipt
        made, not yet answered), its state serialized now; None if none is due. ``result.recovery_path`` names it, and
        is emptied again if the write fails.

        The write runs on the writer thread (``Answers``), before ``item`` is answered: the snapshot records the
        answers of ``item`` and of the operations answered since the run's previous snapshot, so should this
        trainer stop before an answer reaches the gateway, the rebuilt run answers that seq_id's repeat from the
        record (``Sequencer.after``), as applied. A snapshot that cannot be written is logged and skipped: the
        operation stands, recovery replays from the previous snapshot instead, and the next try waits until one is
        due again (``every_ops`` counts from this try, so a store that is down does not hold every later
        operation for its retries)."""
        adapter = self.bank.get(m.model_id)
        if result.error is not None or not self.cfg.snapshots.due(item.op.body, adapter.step,
                                                                   item.seq_id - m.snapshot_tried, m.model_id):
            return None
        result.recovery_path = recovery_path(m.model_id)  # as the record answers it
        m.snapshot_tried = item.seq_id
        snapshot = self.maker.take_snapshot(adapter)

        def write() -> None:
            with self.lock:  # submit() may pass skips into ``answered`` meanwhile
                answers = {s: f.result() for s, f in list(m.seq.answered.items())
                           if m.snapshot_seq < s < item.seq_id and f.done()}
            try:
                self.maker.write_snapshot(snapshot, Record(item.seq_id, {**answers, item.seq_id: result}))
            except Exception as e:  # noqa: BLE001 - the operation stands; only the snapshot is missing
                result.recovery_path = ""
                log.error("recovery snapshot of %s after seq_id %d failed: %s: %s", m.model_id, item.seq_id,
                          type(e).__name__, e)
                return
            m.snapshot_seq = item.seq_id

        return write
