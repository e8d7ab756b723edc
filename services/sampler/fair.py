"""Fair admission order for the sampler: one FIFO line per tenant, served round-robin.

    FairQueue(key)     key(item) -> the tenant an item belongs to
      push(item)       item joins the end of its tenant's line; a tenant without a line joins the rotation last
      peek()           the next item: the head of the line of the tenant whose turn it is (None: empty)
      pop()            takes that item; its tenant, if it has more waiting, moves to the end of the rotation

So a tenant with a backlog of a hundred requests and a tenant with one take turns: the one request is
at most one place behind the head, whatever the backlog. The queue holds references only; the engine
owns the requests and the lock around it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, key: Callable[[T], str]) -> None:
        self._key = key
        self._lines: OrderedDict[str, deque[T]] = OrderedDict()  # rotation order: whose turn is first
        self._len = 0

    def push(self, item: T) -> None:
        self._lines.setdefault(self._key(item), deque()).append(item)
        self._len += 1

    def peek(self) -> T | None:
        return next(iter(self._lines.values()))[0] if self._lines else None

    def pop(self) -> T:
        tenant, line = next(iter(self._lines.items()))
        item = line.popleft()
        self._len -= 1
        if line:
            self._lines.move_to_end(tenant)
        else:
            del self._lines[tenant]
        return item

    def __len__(self) -> int:
        return self._len
