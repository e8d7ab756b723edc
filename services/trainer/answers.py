"""Answers held behind recovery snapshots: the snapshot is written off the cycle thread, the answer waits for it.

A recovery snapshot records the answer of the operation it follows and must be durable before that answer
leaves (``lathe.trainer.recovery``). Written on the cycle thread, it stalled every tenant of the pool: a
SmolLM2 rank-16 run's snapshot is ~70 MB, about a second through the checkpoints service on a 2-core machine,
so eight runs reaching their tenth step together held one cycle for eight seconds. Here the cycle thread
serializes the run's state (``RunMaker.take_snapshot``) and hands the write to a writer thread; the operation is
answered when its snapshot is written (or has failed, which fails nothing: ``recovery``), and every later answer
of that run waits behind it, so a run's answers still leave in the order it applied them. Runs with no write
pending are answered at once, on the calling thread.

Owns: the writer threads and each run's held answers. Never owns the runs, their state or the store.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from lathe.trainer.ops import Result

log = logging.getLogger("lathe.trainer")

WRITERS = 4
"""Runs whose snapshots are written at once. One store that hangs holds at most this many runs' answers beyond its
own; the writes are mostly waiting on the checkpoints service, not on this process's cores."""

_Task = tuple[Future[Result], Result, Callable[[], None] | None]


class Answers:
    def __init__(self, released: Callable[[str], None] = lambda run: None, writers: int = WRITERS) -> None:
        self._released = released  # called with a run once its last held answer is given
        self._writers = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="lathe-snapshots")
        self._lock = threading.RLock()  # a future's done-callback may answer again on this thread
        self._held: dict[str, deque[_Task]] = {}  # run -> its answers not given yet, oldest first

    def answer(self, run: str, future: Future[Result], result: Result, write: Callable[[], None] | None = None
               ) -> None:
        """Set ``future`` to ``result``: at once when ``write`` is None and nothing of ``run`` is held, else on a
        writer thread after ``write()`` (which handles its own failures) and after every earlier held answer of
        ``run``. Runs are written side by side; one run's answers leave in the order they came."""
        with self._lock:
            queue = self._held.get(run)
            if write is None and queue is None:
                future.set_result(result)
                return
            if queue is not None:
                queue.append((future, result, write))
                return
            self._held[run] = deque([(future, result, write)])
        self._writers.submit(self._drain, run)

    def _drain(self, run: str) -> None:
        """Write and answer ``run``'s held tasks in order, until none is left."""
        while True:
            with self._lock:
                future, result, write = self._held[run][0]
            if write is not None:
                try:
                    write()
                except Exception:  # a write reports its own failures; this one must not keep the answers
                    log.exception("writing %s's recovery snapshot failed", run)
            with self._lock:  # answered before it leaves the queue: a later answer cannot overtake it
                future.set_result(result)
                queue = self._held[run]
                queue.popleft()
                if not queue:
                    del self._held[run]
                    break
        self._released(run)

    def holds(self, run: str) -> bool:
        """Are answers of ``run`` waiting for a snapshot write? (No lock taken: callers may hold their own.)"""
        return run in self._held

    def close(self) -> None:
        """Write and answer everything held, then stop the writer threads."""
        self._writers.shutdown(wait=True)
