"""Per-model strict ``seq_id`` order and exactly-once application.

Operations of one training run may arrive in any order and any number of times (the SDK retries, and
splits a large batch so that its first chunk arrives last). ``Sequencer`` releases them strictly as
``next_seq, next_seq + 1, ...``, buffering early arrivals, and answers every repeat of a ``seq_id``
with the future of its first arrival, so nothing is ever applied twice.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lathe.errors import FailedPrecondition

KEEP_RESULTS = 4096  # answered seq_ids remembered per model for late duplicates


@dataclass(slots=True)
class Pending:
    seq_id: int
    op: Any
    future: Future
    arrived: float


@dataclass(slots=True)
class Sequencer:
    next_seq: int = 1
    waiting: dict[int, Pending] = field(default_factory=dict)
    answered: OrderedDict[int, Future] = field(default_factory=OrderedDict)

    def offer(self, seq_id: int, op: Any, now: float) -> tuple[Future, bool]:
        """Queue ``op`` under ``seq_id``; returns its future and whether it is new (False: a repeat)."""
        if seq_id in self.waiting:
            return self.waiting[seq_id].future, False
        if seq_id in self.answered:
            return self.answered[seq_id], False
        if seq_id < self.next_seq:
            raise FailedPrecondition(f"seq_id {seq_id} was applied long ago and its result is no longer kept")
        fut: Future = Future()
        self.waiting[seq_id] = Pending(seq_id, op, fut, now)
        return fut, True

    def peek(self) -> Pending | None:
        """The next operation in order, if it has arrived."""
        return self.waiting.get(self.next_seq)

    def pop(self) -> Pending:
        item = self.waiting.pop(self.next_seq)
        self.next_seq += 1
        self.answered[item.seq_id] = item.future
        while len(self.answered) > KEEP_RESULTS:
            self.answered.popitem(last=False)
        return item

    def __len__(self) -> int:
        return len(self.waiting)
