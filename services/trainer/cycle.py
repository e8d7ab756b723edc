"""Cycle planning: which operations of which training runs go into the next clock cycle.

Each cycle has a token capacity. Runs are visited round-robin from a rotating start, so no tenant
starves behind a large one. For every run the planner takes its next operation in ``seq_id`` order (an
``Op`` of ``lathe.trainer.ops``, checked already at the intake):

- save / load: a control step, run at the start of the cycle;
- optim_step: applied at the end of the cycle;
- forward / forward_backward: its datums join the cycle's packed batch while the capacity lasts. A
  request larger than what is left waits for the next cycle, unless it is larger than a whole cycle:
  then it is split over several cycles, part by part (its gradients accumulate; its result is
  returned when the last part is done). When the last part is planned and the run's next operation
  is an optim_step, that step lands in the same cycle.

A cycle also holds at most ``loss_elements`` (the pool's ``LossBudget.elements``) elements of custom-loss nodes,
all its jobs together (what autograd keeps until the backward): a part whose custom loss would take the cycle past
that waits for a later cycle, unless it is the cycle's first (it then runs, and the step refuses it by name if it
alone is over).

The planner owns no tensors; a split request carries its own progress between cycles (its ``order.Request``). A
pool of several ranks sends each ``Work`` to its followers as a ``lathe.trainer.plan.Step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lathe.errors import LatheError
from lathe.trainer import custom_loss
from lathe.trainer.ops import Example, Load, OptimStep, Save
from lathe.trainer.order import Request, Sequencer


@dataclass(slots=True)
class Work:
    """What one training run does in one cycle: the requests it takes (``compute`` is the run's request in progress,
    the same object over every cycle it spans)."""

    run: object  # the engine's per-run record
    control: Request | None = None
    compute: Request | None = None
    part: tuple[int, int] = (0, 0)  # datum range of ``compute`` in this cycle
    optim: Request | None = None
    fetched: dict[str, bytes] | LatheError | None = None  # a load's checkpoint (or the error reading it) once fetched

    @property
    def last_part(self) -> bool:
        return self.compute is not None and self.part[1] == len(self.compute.examples)


def take_part(examples: list[Example], start: int, budget: int, force: bool) -> int:
    """End index of the datums from ``start`` that fit in ``budget`` tokens (at least one if ``force``)."""
    end, used = start, 0
    while end < len(examples) and used + len(examples[end]) <= budget:
        used += len(examples[end])
        end += 1
    if end == start and force:
        end += 1
    return end


def plan_cycle(
    runs: list[tuple[object, Sequencer, Request | None]],
    capacity: int,
    begin: Callable[[object, Request], bool],
    max_runs: int = 0,
    loss_elements: int = custom_loss.MAX_LOSS_ELEMENTS,
) -> list[Work]:
    """Plan one cycle. ``runs`` are (run, its sequencer, its request in progress), in visiting order.

    ``begin(run, request)`` starts a forward / forward_backward request that reaches the head of its queue:
    it records it as the run's request in progress and returns True (or returns False if it failed to start
    and has been answered already). ``max_runs`` > 0 caps how many runs
    share a cycle (1 = one tenant at a time, the unpacked baseline of the benchmarks).
    """
    works: list[Work] = []
    budget, room = capacity, loss_elements
    for run, seq, current in runs:
        if max_runs and len(works) >= max_runs:
            break
        if current is None:
            head = seq.peek()
            if head is None:
                continue
            body = head.op.body
            if isinstance(body, Save | Load):
                works.append(Work(run, control=seq.pop()))
                continue
            if isinstance(body, OptimStep):
                works.append(Work(run, optim=seq.pop()))
                continue
            if budget < body.tokens <= capacity:
                continue  # fits a later cycle whole: wait rather than split it
            current = seq.pop()
            if not begin(run, current):
                continue
        end = take_part(current.examples, current.done, budget, force=budget == capacity)
        if end == current.done:
            continue  # no room left in this cycle; the run keeps its request in progress
        custom = current.op.body.custom
        elements = 0 if custom is None else custom.elements(
            [(len(ex), ex.inputs) for ex in current.examples[current.done:end]])
        if elements > room and room < loss_elements:
            continue  # its custom loss waits for a cycle with room for it
        room -= elements
        budget -= sum(len(x) for x in current.examples[current.done:end])
        work = Work(run, compute=current, part=(current.done, end))
        if work.last_part:
            nxt = seq.peek()
            if nxt is not None and isinstance(nxt.op.body, OptimStep):
                work.optim = seq.pop()
        works.append(work)
    return works
