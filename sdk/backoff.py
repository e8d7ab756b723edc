"""Capped exponential backoff: the pauses between tries of something that failed in a way that may pass (a service
restarting, a result another process has not recorded yet).

Every retry and poll loop of Lathe takes its pauses from one ``Backoff``: the SDK's calls (``RetryPolicy``), the
gateway's internal calls (``gateway.calls.CallPolicy``) and its polls of the ledger, and the checkpoints client
(``checkpoints.client.Retry``). Each of those names the three numbers in its own configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Backoff:
    """Pauses of ``first_s``, doubling up to ``max_s``, while the try after a pause would start within ``budget_s``
    of this object's making (``math.inf``: for ever)."""

    def __init__(self, first_s: float, max_s: float, budget_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < first_s <= max_s or budget_s < 0:
            raise ValueError(f"a backoff needs 0 < first_s <= max_s and budget_s >= 0, got first_s={first_s}, "
                             f"max_s={max_s}, budget_s={budget_s}")
        self._clock, self._pause, self._max_s = clock, first_s, max_s
        self._give_up = clock() + budget_s

    def next(self) -> float | None:
        """The pause before the next try, or None: that try would start past the budget (give up)."""
        pause = self._pause
        if self._clock() + pause > self._give_up:
            return None
        self._pause = min(2 * pause, self._max_s)
        return pause
