"""Per-model strict ``seq_id`` order and exactly-once application.

Operations of one training run may arrive in any order and any number of times (the SDK retries, and
splits a large batch so that its first chunk arrives last). ``Sequencer`` releases them strictly as
``next_seq, next_seq + 1, ...``, buffering early arrivals, and answers every repeat of a ``seq_id``
with the future of its first arrival, so nothing is ever applied twice.

A ``seq_id`` may never come: the gateway refused it at its door, or the trainer's intake refused it (a client
error, which a retry would meet again), or the client gave up on it. Two ways past such a hole, neither of which
applies anything out of order:

- ``skip``: the ``seq_id`` was refused (an ``ops.Skip``). It is passed over as soon as a later ``seq_id`` is
  waiting, so the operations the client sends next run at once; until then, a corrected operation sent under the
  same ``seq_id`` takes its place (the first one was refused, so nothing of it was ever queued);
- ``give_up``: when operations have waited ``wait`` seconds for a ``seq_id`` that has not arrived
  (``stalled_since``), every operation waiting is answered with a failure naming the ``seq_id`` it waited
  for, and order resumes after the last of them. A late arrival of a seq_id passed over is refused.

A run rebuilt from its recovery snapshot starts ``after`` the snapshot's ``seq_id``; the answers the snapshot
recorded (``lathe.trainer.recovery``) answer repeats of their seq_ids: those operations were applied, though
their answers may never have reached the gateway.

Each operation is one ``Request`` from its arrival to its answer: the sequencer holds it until it is released, and
a forward / forward_backward then carries its own progress over the cycles it spans.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lathe.errors import FailedPrecondition
from lathe.trainer.ops import Example, Op, Result

KEEP_RESULTS = 4096  # answered seq_ids remembered per model for late duplicates


@dataclass(slots=True)
class Request:
    """One ordered operation of a run inside the trainer, from its arrival to its answer. Its run's ``Sequencer``
    holds it until it is released in order; a forward / forward_backward is then its run's request in progress
    (``runs.Run.current``) until it is answered, and the cycle runner folds each part it computes into the
    progress fields below. Whoever answers it sets ``future``."""

    seq_id: int
    op: Op | None  # None: a skipped seq_id (answered already, never run)
    future: Future
    arrived: float  # monotonic
    # a forward / forward_backward's progress, possibly over several cycles
    done: int = 0  # datums finished
    logprobs: list[torch.Tensor] = field(default_factory=list)
    loss: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)  # a custom loss's metrics, summed over datums
    grad_backup: dict[str, torch.Tensor | None] | None = None  # restored if a later part fails

    @property
    def examples(self) -> list[Example]:
        """A forward / forward_backward's datums."""
        return self.op.body.examples


@dataclass(slots=True)
class Sequencer:
    next_seq: int = 1
    waiting: dict[int, Request] = field(default_factory=dict)
    answered: OrderedDict[int, Future] = field(default_factory=OrderedDict)
    reached: float = field(default_factory=time.monotonic)  # when ``next_seq`` became the next one (monotonic)

    @classmethod
    def after(cls, seq_id: int, answers: dict[int, Result]) -> Sequencer:
        """The sequencer of a run rebuilt from a snapshot taken after ``seq_id`` that recorded ``answers`` (seq_id
        -> the answer it was given): next comes ``seq_id + 1``, and a repeat of a recorded seq_id gets its answer."""
        seq = cls(next_seq=seq_id + 1)
        for s, result in sorted(answers.items()):
            fut: Future = Future()
            fut.set_result(result)
            seq.answered[s] = fut
        return seq

    def offer(self, seq_id: int, op: Op | None, now: float) -> tuple[Future, bool]:
        """Queue ``op`` under ``seq_id``; returns its future and whether it is new (False: a repeat)."""
        if seq_id in self.waiting and (op is None or self.waiting[seq_id].op is not None):
            return self.waiting[seq_id].future, False
        if seq_id in self.answered:
            return self.answered[seq_id], False
        if seq_id < self.next_seq:
            raise FailedPrecondition(f"seq_id {seq_id} is behind this run's next seq_id {self.next_seq}: it was "
                                     "applied, skipped or given up on, and its answer is no longer kept")
        fut: Future = Future()
        self.waiting[seq_id] = Request(seq_id, op, fut, now)  # in place of a skip, if one held the seq_id
        self._pass_skips(now)
        return fut, True

    def skip(self, seq_id: int, answer: Result, now: float) -> Future:
        """Mark ``seq_id`` as refused before it was queued, answered with ``answer`` at once. A seq_id that has
        arrived already keeps its own answer; one held by an earlier refusal (not yet passed over) takes this
        one's answer, so each refused request is answered with its own error."""
        held = self.waiting.get(seq_id)
        if held is not None and held.op is None:
            del self.waiting[seq_id]
        fut, new = self.offer(seq_id, None, now)
        if new:
            fut.set_result(answer)
        return fut

    def peek(self) -> Request | None:
        """The next operation in order, if it has arrived (a skip is never one)."""
        head = self.waiting.get(self.next_seq)
        return head if head is not None and head.op is not None else None

    def pop(self, now: float | None = None) -> Request:
        """Take the next operation (``peek`` has it); ``now`` defaults to the monotonic clock."""
        now = time.monotonic() if now is None else now
        item = self._take(now)
        self._pass_skips(now)
        return item

    def stalled_since(self) -> float | None:
        """Since when operations have waited for a ``next_seq`` that has not arrived (None: nothing waits)."""
        if not self.waiting or self.next_seq in self.waiting:
            return None
        return max(self.reached, min(p.arrived for p in self.waiting.values()))

    def give_up(self, now: float) -> list[tuple[Request, str]]:
        """Stop waiting for ``next_seq``: every operation waiting (skips aside) is returned with the reason it
        fails, to be answered by the caller; they count as answered, and order resumes after the last one."""
        missing = self.next_seq
        failed = []
        for seq_id in sorted(self.waiting):
            item = self.waiting.pop(seq_id)
            self._remember(item)
            if item.op is not None:
                waited = now - max(item.arrived, self.reached)
                failed.append((item, f"seq_id {seq_id} waited {waited:.0f} s for seq_id {missing}, which never "
                                     f"arrived (operations of a run are applied strictly in seq_id order)"))
            self.next_seq = seq_id + 1
        self.reached = now
        return failed

    def _take(self, now: float) -> Request:
        item = self.waiting.pop(self.next_seq)
        self.next_seq += 1
        self.reached = now
        self._remember(item)
        return item

    def _pass_skips(self, now: float) -> None:
        """Pass over skips at the head while a later operation waits behind them."""
        while len(self.waiting) > 1 and (head := self.waiting.get(self.next_seq)) is not None and head.op is None:
            self._take(now)

    def _remember(self, item: Request) -> None:
        self.answered[item.seq_id] = item.future
        while len(self.answered) > KEEP_RESULTS:
            self.answered.popitem(last=False)

    def __len__(self) -> int:
        return len(self.waiting)
