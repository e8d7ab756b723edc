"""When the next cycle starts: ``GatherWindow``, the wait between "something is ready" and running a cycle.

Owned by the engine and used under its lock: the cycle thread ``wait``s in it before each cycle and tells it which
runs a cycle had (``after_cycle``); the snapshot writers tell it when a run's held answers went out
(``write_done``). It reads the runs' queues, never changes them.

Clients answered by one cycle resubmit together, but through the gateway a burst of them spreads out (8 SDK
clients on 2 cores: 0.1-0.2 s), and a cycle that starts with the first few leaves the rest to a second cycle that
shares nothing with it. So the wait for the last cycle's runs lasts a window (a few percent of that cycle, at most
``rejoin_max_s``) after the cycle and is renewed each time one of them comes back: the burst joins one cycle
however many it holds, and a run that does not come back (it left to sample, or finished) costs the window once.
A run whose answer waits for its snapshot write keeps the window open up to ``rejoin_write_max_s`` after the cycle:
the write was the trainer's doing, and in a pool stepping in lock step a cycle that left it behind would cost a
second pass a round. Independently, a forward_backward at the head of a queue waits up to ``cycle_gather_s`` for
the optim_step its client sends right behind it, so that both land in one cycle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from lathe.trainer.config import TrainerConfig
from lathe.trainer.ops import ForwardBackward
from lathe.trainer.order import Sequencer


class Run(Protocol):
    """What the window reads of a run: whether it has work for a cycle, and its queue."""

    seq: Sequencer

    @property
    def ready(self) -> bool: ...


class GatherWindow:
    def __init__(self, cfg: TrainerConfig, lock: threading.Condition, holds: Callable[[str], bool]) -> None:
        """``lock``: the engine's; ``holds(run)``: whether ``run``'s answers wait for its snapshot write."""
        self.cfg, self.lock, self.holds = cfg, lock, holds
        self.runs: set[str] = set()  # the last cycle's, which the next one waits for
        self.span = 0.0  # how long after the last cycle, or after one of its runs came back
        self.until = 0.0  # until when
        self.seen = 0  # how many of them have come back so far
        self.write_end = 0.0  # the latest the window stays open for a run whose snapshot is being written

    @property
    def gather_s(self) -> float:
        """How long after something is ready a cycle may wait at most for an optim_step."""
        return max(self.cfg.cycle_gather_s, self.span)

    def after_cycle(self, runs: set[str], start: float, end: float) -> None:
        """A cycle over ``runs`` ran from ``start`` to ``end`` (caller holds the lock)."""
        self.runs = runs
        self.span = min(self.cfg.rejoin_max_s, self.cfg.rejoin_fraction * (end - start))
        self.until, self.seen = end + self.span, 0
        self.write_end = end + self.cfg.rejoin_write_max_s

    def wait(self, models: Mapping[str, Run], stopping: Callable[[], bool], step_deadline: float) -> None:
        """Something is ready; wait (caller holds the lock) while a forward_backward at a queue's head waits for its
        optim_step (until ``step_deadline``) or a run of the last cycle has not sent its next operation yet. In all,
        at most one window more than the last cycle had runs."""
        while not stopping():
            now = time.monotonic()
            if (n := self._rejoined(models)) > self.seen:
                self.seen, self.until = n, max(self.until, now + self.span)
            if self.awaiting_write():
                self.until = max(self.until, min(now + self.span, self.write_end))
            left = max(step_deadline - now if _awaiting_step(models) else 0.0,
                       self.until - now if self._awaiting_rejoin(models) else 0.0)
            if left <= 0:
                return
            self.lock.wait(timeout=left)

    def awaiting_write(self) -> bool:
        """Is a run of the last cycle idle because its answer waits for its snapshot write?"""
        return any(self.holds(r) for r in self.runs)

    def write_done(self, run: str) -> None:
        """``run``'s held answers went out: the window restarts for it (its client resubmits now)."""
        with self.lock:
            if run in self.runs:
                self.until = max(self.until, time.monotonic() + self.span)
                self.lock.notify_all()

    def _rejoined(self, models: Mapping[str, Run]) -> int:
        """How many runs of the last cycle have an operation waiting again."""
        return sum((m := models.get(r)) is not None and m.ready for r in self.runs)

    def _awaiting_rejoin(self, models: Mapping[str, Run]) -> bool:
        """Is a run of the last cycle idle while the next cycle still has room for it?"""
        if not any((m := models.get(r)) is not None and not m.ready for r in self.runs):
            return False
        limit = self.cfg.max_runs_per_cycle
        return not limit or sum(m.ready for m in models.values()) < limit


def _awaiting_step(models: Mapping[str, Run]) -> bool:
    """Is a forward_backward at the head of a queue whose next operation has not arrived yet?"""
    for m in models.values():
        head = m.seq.peek()
        if (head is not None and isinstance(head.op.body, ForwardBackward) and head.op.body.backward
                and m.seq.next_seq + 1 not in m.seq.waiting):
            return True
    return False
