"""The trainer engine: adapter bank + ordered queues + the clock cycle, with no gRPC in sight.

What comes in: plain ``Op``s (``lathe.trainer.ops``), decoded from ``pb.TrainerOp`` and checked once by the
intake (``lathe.trainer.intake``) on the caller's thread, outside this engine's lock, against the run's
``limits(model_id)``; a request that failed its checks arrives as a ``Skip`` carrying its error. What goes out:
one ``ops.Result`` per operation (an output or an error, and its receipt), through a future.

Data path: ``submit(op)`` puts an operation into its model's ``Sequencer`` (strict ``seq_id`` order, exactly
once) and returns a future; a ``Skip`` is answered at once and its seq_id passed over. The cycle thread
repeatedly takes, for every model, its next operations in order: at most one forward / forward_backward plus
the optim_step right behind it, or one save / load; ``runner.CycleRunner`` runs the cycle: saves and loads first,
then all forward / forward_backward jobs of one base model as ONE packed pass (``step.run_jobs``), then the due
optim_steps.
Each operation gets its own result and receipt. A failing operation (non-finite loss, a checkpoint that
cannot be read) fails alone and changes nothing; so does one that trips over a bug: no exception stops the
cycle thread. Should the thread end anyway, the operations still waiting get ``Unavailable`` and so does every
later call (``alive`` reports it), so callers are told instead of waiting forever.

A seq_id that never comes does not hold its run for ever: one refused at the gateway's door or at the intake
is passed over (``Skip``), and operations that waited ``order_wait_s`` for a missing one fail, naming it. One
tenant's operations may fill at most ``max_queue_per_tenant`` places of the shared queue (``max_queue``); the
operation a run is waiting for is always let in (``runs.Runs.admit``).

Owns: the lock, the cycle and the cycle metrics, the ``AdapterBank`` (it pages least recently used adapters out
beyond ``max_resident_adapters`` and a tenant's own quota) and ``runs.Runs`` (the runs, their queues, their creation
and recovery snapshots, through ``lifecycle.RunMaker`` and the checkpoints service). Base models are
``lifecycle.BaseModels``'; the thread that runs the cycles (when the next one is due, a leader's heartbeats, how the
thread ends) is ``cycle_thread.CycleThread``'s.

A pool of several ranks (``group``, ``lathe.trainer.dist``): this engine on rank 0 is the cycle leader and the
only one with queues, a store and callers. Each cycle it fetches what its loads read, broadcasts the cycle as a
``lathe.trainer.plan.Plan`` (with the runs created since the last one), and every rank then runs the same
``_execute`` (its ``CycleRunner``): controls, the packed pass split by adapter over the ranks
(``lathe.trainer.shard``), optim_steps. A follower's engine applies the plans (``replay``), so every rank holds
the same adapters bit for bit; only the leader writes checkpoints and snapshots. When a collective fails
(``RankLost``) the leader answers every operation it holds with that retryable error, refuses new ones, and calls
``on_rank_lost`` (the process exits and the pool re-forms; docs/distributed.md). An idle leader broadcasts an
empty plan every ``heartbeat_s`` (``CycleThread.beat``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from lathe.errors import (
    Internal,
    LatheError,
    NotFound,
    Unavailable,
)
from lathe.models.catalog import ModelCatalog
from lathe.models.decoder import Decoder
from lathe.models.exactness import PoolExactness
from lathe.models.pool import on_passing_thread
from lathe.trainer.answers import Answers
from lathe.trainer.bank import AdapterBank
from lathe.trainer.config import TrainerConfig
from lathe.trainer.cycle import Work, plan_cycle
from lathe.trainer.cycle_thread import CycleThread
from lathe.trainer.dist import Group, RankLost
from lathe.trainer.lifecycle import BaseModels, CheckpointStore, RunMaker
from lathe.trainer.metrics import CycleMetrics
from lathe.trainer.ops import Limits, Op, Result, Skip
from lathe.trainer.order import Request
from lathe.trainer.pages import DirPages
from lathe.trainer.plan import Plan, Step
from lathe.trainer.runner import CycleRunner
from lathe.trainer.runs import Run, Runs
from lathe.trainer.window import GatherWindow
from lathe.types import (
    Receipt,
)
from lathe.v1 import lathe_pb2 as pb

log = logging.getLogger("lathe.trainer")


def _fail(item: Request, err: LatheError) -> None:
    """Answer ``item`` with ``err`` unless it has its answer already (no receipt: it never ran)."""
    if not item.future.done():
        item.future.set_result(Result(error=err))


def _replayed(op: Op | None) -> Request | None:
    """A follower's stand-in for the leader's queued operation ``op`` (nobody waits on its future)."""
    return None if op is None else Request(op.seq_id, op, Future(), time.monotonic())


def _step(w: Work) -> Step:
    """``w`` as the followers receive it; a request whose first part runs now starts with it."""
    return Step(w.run.model_id, control=w.control.op if w.control is not None else None, fetched=w.fetched,
                begin=w.compute.op if w.compute is not None and w.part[0] == 0 else None,
                part=w.part if w.compute is not None else None, optim=w.optim.op if w.optim is not None else None)


def _fail_cycle(works: list[Work], err: LatheError, bank: AdapterBank) -> None:
    """Answer every operation of ``works`` not answered yet with ``err``; their runs drop their request in progress
    (restoring the gradients it had added to, when they were saved)."""
    for w in works:
        if w.compute is not None and not w.compute.future.done():
            if w.compute.grad_backup is not None:
                for n, param in bank.get(w.run.model_id).weights.named_parameters().items():
                    param.grad = w.compute.grad_backup[n]
            w.run.current = None
        for item in (w.control, w.compute, w.optim):
            if item is not None:
                _fail(item, err)


class TrainerEngine:
    def __init__(self, cfg: TrainerConfig, catalog: ModelCatalog, store: CheckpointStore | None = None,
                 group: Group | None = None, on_rank_lost: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.catalog = catalog
        self.store = store
        self.group = group  # None: a pool of one process, nothing to broadcast or exchange
        self.on_rank_lost = on_rank_lost
        self.cycle = 0
        self.metrics = CycleMetrics()
        self.metrics.capacity.set(cfg.cycle_tokens)
        self.exactness = PoolExactness("trainer", cfg.invariant,
                                       lambda name, exact: self.metrics.exactness.labels(model=name).set(exact),
                                       backward=True)
        self.bases = BaseModels(cfg, catalog, self.exactness)
        self.maker = RunMaker(cfg, self.bases, store)
        pages = DirPages(Path(cfg.page_store) if cfg.page_store else cfg.cache_root / "paged")
        self.bank = AdapterBank(cfg.max_resident_adapters, pages, cfg.dtype, lambda name: self.bases.get(name).cfg,
                                cfg.device)
        self.runner = CycleRunner(cfg, self.bank, self.bases, self.maker, self.metrics, group, self._finish)
        self._lock = threading.Condition()
        leader = group is not None and group.leader  # a pool's followers write nothing and send no plans
        self.runs = Runs(cfg, self.maker, self.bank, self._lock, writes=store is not None and (group is None or leader),
                         leader=leader, evict=lambda: self._evict(self._pinned()))
        self._models = self.runs.models  # the runs' records, read by the queues and the cycle under the lock
        self.answers = Answers(lambda run: self.window.write_done(run))  # answers, held behind snapshot writes
        self.window = GatherWindow(cfg, self._lock, self.answers.holds)  # when the next cycle starts
        # run_cycle is looked up at each cycle, not bound here (a test replaces it on a live engine)
        self.cycle_thread = CycleThread(self._lock, self.runs, self.window, group, fail=_fail,
                                        run_cycle=lambda: self.run_cycle(), lost=lambda: self._lost is not None,
                                        fail_waiting=self._fail_waiting)
        self._in_cycle: set[str] = set()  # runs of the cycle computing now: their adapters stay resident
        self._lost: RankLost | None = None  # why the pool broke, once it did

    # ---- runs and their adapters (made by ``lifecycle.RunMaker``) ----

    def base(self, name: str) -> Decoder:
        """The served base model ``name`` (``lifecycle.BaseModels``)."""
        return self.bases.get(name)

    def capabilities(self) -> pb.ServerCapabilities:
        self._check_alive()
        return self.bases.capabilities()

    @property
    def alive(self) -> bool:
        """False once the cycle thread has ended without ``stop``: the pool is not ready and says so."""
        return not self.cycle_thread.died

    def _check_alive(self) -> None:
        if self._lost is not None:
            raise RankLost(self._lost.message)
        if self.cycle_thread.died:
            raise Unavailable("this trainer's cycle thread has stopped; the pool is not ready")

    def create_adapter(self, req: pb.CreateAdapterRequest) -> pb.AdapterInfo:
        """Create (or, for a repeat of the same request, return) the adapter of a training run; its tensors are
        made on a passing thread (``on_passing_thread``), never on the caller's.

        With ``req.recover_from`` (a rebuild after a trainer restart) the run is made again from its recovery
        snapshot and nothing else (``lathe.trainer.recovery``): a fresh run whose state was never snapshotted (it
        lost nothing the gateway's log does not hold) is made fresh again, as its record says, and a missing
        snapshot is ``FailedPrecondition`` naming the run, never a fresh adapter in its place. A run that exists here
        already, rebuilt or not, is left as it is and answered as it is now (``next_seq_id`` included): two
        gateways that both found it gone rebuild it once."""
        return on_passing_thread(self._create_adapter, req, name="trainer-create")

    def _create_adapter(self, req: pb.CreateAdapterRequest) -> pb.AdapterInfo:
        self._check_alive()
        return self.runs.create(req)

    # ---- submission ----

    def limits(self, model_id: str) -> Limits:
        """What a forward_backward on run ``model_id`` must fit (its base model's vocabulary and context, this
        pool's request size): the intake checks requests against it before they are queued."""
        self._check_alive()
        with self._lock:
            if model_id not in self._models:
                raise NotFound(f"unknown model_id {model_id!r}")
            base = self.bank.base_model(model_id)
        cfg = self.bases.get(base).cfg
        return Limits(cfg.vocab_size, cfg.max_position_embeddings, self.cfg.max_request_tokens, self.cfg.loss_budget)

    def submit(self, op: Op) -> Future[Result]:
        """Queue one ordered operation (a ``Skip`` is answered at once); the future resolves to its ``Result``."""
        self._check_alive()
        with self._lock:
            m = self._models.get(op.model_id)
            if m is None or m.tenant != op.tenant:
                raise NotFound(f"unknown model_id {op.model_id!r}")
            # the operation a run is waiting for is always let in (refusing it could block the run for good),
            # and so is a repeat, which takes no new place
            if op.seq_id != m.seq.next_seq and op.seq_id not in m.seq.waiting:
                self.runs.admit(op.tenant)
            if isinstance(op.body, Skip):
                fut, new = m.seq.skip(op.seq_id, Result(error=op.body.error), time.monotonic()), True
            else:
                fut, new = m.seq.offer(op.seq_id, op, time.monotonic())
            if new:
                self._lock.notify_all()
            return fut

    # ---- the cycle ----

    def start(self) -> None:
        self.cycle_thread.start()

    def stop(self) -> None:
        self.cycle_thread.stop()
        self.answers.close()

    def _fail_waiting(self, err: LatheError) -> None:
        """Answer every queued operation and request in progress with ``err``."""
        with self._lock:
            items = self.runs.drain()
        for item in items:
            _fail(item, err)

    def _lose_pool(self, works: list[Work], err: RankLost) -> None:
        """A collective failed: answer this cycle's operations and every waiting one with ``err`` (retryable),
        refuse new ones, and hand over to ``on_rank_lost``."""
        log.error("%s", err.message)
        self._lost = err
        _fail_cycle(works, err, self.bank)
        self._fail_waiting(err)
        if self.on_rank_lost is not None:
            self.on_rank_lost()

    def _begin(self, m: Run, item: Request) -> bool:
        """Start a forward / forward_backward request (checked at the intake) as it reaches the head of its
        run's queue: it becomes the run's request in progress; one split over several cycles first keeps a copy of
        the gradients it will add to. Returns whether it started.

        Whatever goes wrong here (e.g. out of memory) answers this request alone."""
        body = item.op.body
        try:
            if body.backward and body.tokens > self.cfg.cycle_tokens:
                item.grad_backup = {n: None if p.grad is None else p.grad.clone()
                                    for n, p in self.bank.get(m.model_id).weights.named_parameters().items()}
        except Exception as e:  # noqa: BLE001 - one request's failure, never the cycle thread's
            err = Internal(f"starting seq_id {item.seq_id} failed: {type(e).__name__}: {e}")
            self._finish(m, item, self.cycle + 1, time.monotonic(), Result(error=err))
            return False
        m.current = item
        return True

    def run_cycle(self) -> int:
        """Run one cycle over whatever is ready; returns the number of runs it touched. A pool's leader
        broadcasts the cycle's plan first (an empty one, a heartbeat, when nothing is ready); a failed
        collective answers everything with ``RankLost`` and raises it."""
        t0 = time.monotonic()
        with self._lock:
            runs = list(self._models.values())
            if runs:
                k = self.cycle % len(runs)
                runs = runs[k:] + runs[:k]
            works = plan_cycle([(m, m.seq, m.current) for m in runs], self.cfg.cycle_tokens, self._begin,
                               self.cfg.max_runs_per_cycle, self.cfg.loss_budget.elements)
            creates = self.runs.take_creates()
            self.cycle += bool(works)
            cycle = self.cycle
            queued = sum(len(m.seq) for m in self._models.values())
            self._in_cycle = {w.run.model_id for w in works}
        start = time.monotonic()
        try:
            for w in works:
                self.runner.fetch(w)
            if self.group is not None:
                self.cycle_thread.beat(start)
                self.group.broadcast(Plan(cycle, creates, [_step(w) for w in works]))
            if not works:
                return 0
            self.metrics.planning_seconds.observe(start - t0)
            tokens = self._execute(works, cycle, start)
        except RankLost as e:
            self._lose_pool(works, e)
            raise
        end = time.monotonic()
        self.metrics.record_cycle(seconds=end - start, tokens=tokens, capacity=self.cfg.cycle_tokens,
                                  runs=len(works), tenants=len({w.run.tenant for w in works}), queued=queued)
        with self._lock:
            self.window.after_cycle({w.run.model_id for w in works}, start, end)
        return len(works)

    def _execute(self, works: list[Work], cycle: int, start: float) -> int:
        """Run a planned cycle (the same on every rank of a pool): controls, the packed pass, optim_steps.
        Returns the tokens computed; raises only ``RankLost``."""
        tokens = 0
        try:
            tokens = self.runner.run(works, cycle, start)
        except RankLost:
            raise
        except Exception as e:  # noqa: BLE001 - a bug fails this cycle's unanswered operations, not the thread
            _fail_cycle(works, Internal(f"cycle {cycle} failed: {type(e).__name__}: {e}"), self.bank)
        finally:
            with self._lock:
                self._in_cycle = set()
                self._evict(self._pinned())
        return tokens

    def replay(self, plan: Plan) -> None:
        """A follower's whole job: apply one plan of the leader, its new runs first, then its cycle, through
        the same ``_execute`` as the leader. Raises ``RankLost`` if a collective fails, and RuntimeError if
        this rank's state no longer matches the plan (the pool must re-form)."""
        for c in plan.creates:
            self.runs.make(pb.CreateAdapterRequest.FromString(c.request), c.snapshot, c.state)
        if not plan.steps:
            return
        with self._lock:
            self.cycle = plan.cycle
            works = [self._replayed_work(s) for s in plan.steps]
            self._in_cycle = {s.model_id for s in plan.steps}
        self._execute(works, plan.cycle, time.monotonic())

    def _replayed_work(self, s: Step) -> Work:
        m = self._models[s.model_id]
        w = Work(m, control=_replayed(s.control), optim=_replayed(s.optim), fetched=s.fetched)
        if s.part is None:
            return w
        if s.begin is not None and not self._begin(m, _replayed(s.begin)):
            raise RuntimeError(f"this rank could not start seq_id {s.begin.seq_id} of {s.model_id}, which the "
                               "leader started")
        if m.current is None or m.current.done != s.part[0]:
            raise RuntimeError(f"the leader computes datums {s.part} of {s.model_id}, but this rank has "
                               f"{'no request in progress' if m.current is None else f'{m.current.done} done'}")
        w.compute, w.part = m.current, s.part
        return w

    def _pinned(self) -> set[str]:
        """Runs whose adapters must stay resident: the cycle computing now, and requests in progress."""
        return self._in_cycle | self.runs.in_progress()

    def _evict(self, pinned: set[str]) -> None:
        self.bank.evict(pinned)
        self.metrics.resident_adapters.set(self.bank.resident)
        self.metrics.paged_adapters.set(self.bank.paged)

    def _finish(self, m: Run, item: Request, cycle: int, start: float, result: Result, tokens: int = 0) -> None:
        fingerprint, exact = self.exactness.stamp(self.bank.base_model(m.model_id))
        result.receipt = Receipt(
            request_id=item.op.request_id, model_id=item.op.model_id, seq_id=item.seq_id, cycle=cycle,
            tokens=tokens, adapter_step=self.bank.get(m.model_id).step, queued_s=start - item.arrived,
            run_s=time.monotonic() - start, dtype=self.cfg.dtype, op=item.op.kind, fingerprint=fingerprint,
            exact=exact)
        write = self.runs.snapshot(m, item, result) if self.store is not None else None
        self.metrics.wait_seconds.observe(max(0.0, start - item.arrived))
        self.answers.answer(m.model_id, item.future, result, write)  # after the snapshot, which records it
