"""The trainer's cycle thread: ``CycleThread`` decides when the engine runs its next cycle, runs it, and ends.

Under the engine's lock it waits until some run has work for a cycle (``Runs.ready``), answering as it waits the
operations that waited ``order_wait_s`` for a missing seq_id (``Runs.expire``, through ``fail``), or until an idle
pool leader owes its followers a heartbeat (``heartbeat_s`` after the last plan it broadcast: ``beat``); then it
waits in the ``GatherWindow`` and calls the engine's ``run_cycle`` outside the lock. A cycle answers its own
operations, so no exception of one stops the thread; a ``RankLost`` ends it (the cycle answered everything, and the
pool re-forms without this process).

How it ends: stopped (``stop``), a pool's leader tells its followers to stop too (a ``None`` plan). Otherwise,
unless the pool broke (``lost``: its operations are answered already), the thread has died: ``died`` turns True (the
pool is not ready, and the engine refuses every later call) and every operation still waiting is answered with
``Unavailable`` (``fail_waiting``), so nobody waits forever on a thread that is gone.

Owns: the thread, its stop flag, the heartbeat clock and whether the thread died. The lock, the runs, the window and
the cycle itself are the engine's (``lathe.trainer.engine``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable

from lathe.errors import LatheError, Unavailable
from lathe.trainer.dist import Group, RankLost
from lathe.trainer.order import Request
from lathe.trainer.runs import Runs
from lathe.trainer.window import GatherWindow


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class CycleThread:
    def __init__(self, lock: threading.Condition, runs: Runs, window: GatherWindow, group: Group | None, *,
                 fail: Callable[[Request, LatheError], None], run_cycle: Callable[[], int],
                 lost: Callable[[], bool], fail_waiting: Callable[[LatheError], None]) -> None:
        """``lock``, ``runs``, ``window``, ``group``: the engine's; ``fail(item, err)`` answers one operation;
        ``run_cycle()`` runs one cycle; ``lost()``: whether the pool broke; ``fail_waiting(err)`` answers every
        queued operation and request in progress."""
        self.lock, self.runs, self.window, self.group = lock, runs, window, group
        self.fail, self.run_cycle, self.lost, self.fail_waiting = fail, run_cycle, lost, fail_waiting
        self.stopping = False
        self.died = False  # the thread ended without being stopped
        self.last_beat = time.monotonic()  # when the leader last broadcast a plan
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainer-cycle", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread once the cycle it runs, if any, is done (waiting at most 30 s for it)."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def beat(self, now: float) -> None:
        """A pool's leader broadcast a plan at ``now``: its next heartbeat is due ``heartbeat_s`` after it."""
        self.last_beat = now

    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    wait_s = self.runs.expire(time.monotonic(), self.fail)
                    while not self.stopping and not self.runs.ready() and not self._beat_due():
                        self.lock.wait(timeout=_sooner(wait_s, self._beat_left()))
                        wait_s = self.runs.expire(time.monotonic(), self.fail)
                    self.window.wait(self.runs.models, lambda: self.stopping, time.monotonic() + self.window.gather_s)
                    if self.stopping:
                        return
                try:
                    self.run_cycle()
                except RankLost:
                    return  # run_cycle answered everything; the pool re-forms without this process
                except Exception:  # noqa: BLE001 - run_cycle answers its operations itself; the loop goes on
                    traceback.print_exc(file=sys.stderr)
        finally:
            self._after_loop()

    def _beat_left(self) -> float | None:
        """Seconds until an idle pool leader owes its followers a heartbeat (None: no followers)."""
        if self.group is None:
            return None
        return self.last_beat + self.group.cfg.heartbeat_s - time.monotonic()

    def _beat_due(self) -> bool:
        left = self._beat_left()
        return left is not None and left <= 0

    def _after_loop(self) -> None:
        """The thread is ending. Stopped: a pool's leader tells its followers to stop too. Otherwise, unless the
        pool broke (answered already), mark the thread dead and answer every operation still waiting with
        ``Unavailable``: nobody waits forever on a thread that is gone."""
        if self.stopping:
            if self.group is not None and not self.lost():
                with contextlib.suppress(RankLost):  # a follower gone already stops anyway
                    self.group.broadcast(None)
            return
        if self.lost():
            return
        self.died = True
        self.fail_waiting(Unavailable("this trainer's cycle thread stopped before running this operation; retry "
                                      "on a healthy pool"))
