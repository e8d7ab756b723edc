"""Completion queues: which samples of a sampling client have finished, for Tinker's ``/retrieve_futures``.

One queue per (sampling session id, client number) — the client number being ``seq_id // CLIENT_STRIDE``, as
Tinker's SDK numbers its clones. The core ``watch``es each sample it starts and reports it ``done`` when its
result is recorded; a poller reads the events after its cursor (``wait``, a long-poll) and, by passing that
cursor back, lets the queue drop what it has seen. Cursors come from one counter per process that starts at the
wall clock in microseconds, so a restarted gateway's cursors are past the ones it handed out before.

In memory only: the waiters and the events not yet seen, at most ``KEEP`` per queue (the oldest go first; a
poller that fell that far behind still gets each result from ``/retrieve_future``). A sample re-sent after a
restart (``GatewayCore.restore``) is watched again; one another gateway runs is not seen here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from lathe.types import CLIENT_STRIDE

KEEP = 10_000  # unseen events kept per queue

Key = tuple[str, int]  # (sampling session id, client number)


@dataclass(frozen=True, slots=True)
class Completion:
    cursor: int
    request_id: str
    failed: bool


@dataclass(slots=True)
class _Queue:
    events: deque[Completion] = field(default_factory=lambda: deque(maxlen=KEEP))
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0


def queue_key(sampling_session_id: str, seq_id: int) -> Key:
    return sampling_session_id, seq_id // CLIENT_STRIDE


class CompletionQueues:
    def __init__(self) -> None:
        self._queues: dict[Key, _Queue] = {}
        self._watched: dict[str, Key] = {}  # request id -> its queue, until it is done
        self._cursor = itertools.count(time.time_ns() // 1000)

    def watch(self, request_id: str, key: Key) -> None:
        self._watched[request_id] = key

    def done(self, request_id: str, failed: bool) -> None:
        """Report a watched request finished (``failed``: with an error); others are ignored."""
        key = self._watched.pop(request_id, None)
        if key is None:
            return
        q = self._queues.setdefault(key, _Queue())
        q.events.append(Completion(next(self._cursor), request_id, failed))
        q.changed.set()

    async def wait(self, key: Key, prev_cursor: int, timeout_s: float) -> tuple[list[Completion], int]:
        """The events after ``prev_cursor`` (those up to it are dropped), held up to ``timeout_s`` while there
        are none, and the cursor to pass next (``prev_cursor`` when nothing came)."""
        q = self._queues.setdefault(key, _Queue())
        while q.events and q.events[0].cursor <= prev_cursor:
            q.events.popleft()
        if not q.events and timeout_s > 0:
            q.changed.clear()
            q.waiters += 1
            try:
                await asyncio.wait_for(q.changed.wait(), timeout_s)
            except TimeoutError:
                pass
            finally:
                q.waiters -= 1
        events = list(q.events)
        if not events and not q.waiters:
            self._queues.pop(key, None)  # nothing unseen, nobody waiting: the next event makes it again
        return events, events[-1].cursor if events else prev_cursor
