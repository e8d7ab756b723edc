"""What the cycle leader broadcasts to the followers of a trainer pool: everything that changes adapter state.

A follower owns no queue and reads no store: it applies, in order, what the leader decided and fetched. Per
broadcast (one per cycle, or a heartbeat when the leader is idle):

    Plan.creates   runs created on the leader since the last plan, with the bytes they were built from
                   (a recovery snapshot or a saved training state, read by the leader from the checkpoints
                   service), so every rank builds the same adapter
    Plan.steps     the cycle's works (``lathe.trainer.cycle.Work``) as plain values: the decoded ``Op`` of each
                   control / starting forward_backward / optim_step, the datum range of the part computed now,
                   and for a load the checkpoint files the leader fetched (or the error it met)

A ``None`` broadcast tells the followers the leader stopped cleanly. Everything here is picklable (ops hold CPU
tensors); nothing knows torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lathe.errors import LatheError
from lathe.trainer.ops import Op

Files = dict[str, bytes]


@dataclass(slots=True)
class Create:
    request: bytes  # a serialized ``pb.CreateAdapterRequest``
    snapshot: Files | None  # the run's recovery snapshot, when it was rebuilt from one
    state: Files | None  # the training state it was created from (``from_path``)


@dataclass(slots=True)
class Step:
    """One run's share of a cycle (a ``Work``)."""

    model_id: str
    control: Op | None = None
    fetched: Files | LatheError | None = None  # a load's checkpoint, as the leader read it
    begin: Op | None = None  # a forward / forward_backward that starts in this cycle
    part: tuple[int, int] | None = None  # datum range of the request in progress computed in this cycle
    optim: Op | None = None


@dataclass(slots=True)
class Plan:
    cycle: int
    creates: list[Create] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
