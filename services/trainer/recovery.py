"""Recovery snapshots: what a restarted trainer rebuilds a training run from.

A trainer keeps every run's adapter in memory, so a crash (``kill -9``, an OOM kill, a lost node) loses
them. The classic answer is a write-ahead log plus checkpoints, split between two rooms:

- the gateway's ledger holds every acknowledged operation's request (the log);
- the trainer writes a **recovery snapshot** of a run right after applying some of its operations: every
  ``every_steps``-th optimizer step (each run's count offset by its model id: ``stagger``), every training-state save,
  every load (so a rebuild never reads a checkpoint again: it may have been overwritten or deleted since), and at
  least every ``every_ops`` seq_ids (so a forward-only run has them too). A snapshot is the run's whole state at that
  point, in the paging format (LoRA weights, AdamW moments, step and the gradients accumulated but not yet applied),
  stored through the checkpoints service at ``tinker://<run>/recovery/latest`` (overwritten in place; it expires
  ``ttl_s`` after its last write, so an abandoned run's snapshot goes away).

Every run has one from its creation on (seq_id 0), so that recovery never needs anything but the snapshot: a
run created from a saved training state gets a snapshot of that state, and a fresh run a record of its own
(``recovery.json`` alone, ``state: false``): a fresh adapter's initialization is a deterministic function of its
LoRA config and model id, so its rebuild makes it again from the creation fields of the rebuild request.

``recovery.json`` (a ``Record``) carries the ``seq_id`` the snapshot was taken after (the operation's receipt
names it too, and the gateway keeps the logged operations after it) and the **answers** of the operations
answered since the run's previous snapshot, up to and including that one. A snapshot is written before the
operation it follows is answered, so the trainer may stop after the snapshot and before an answer reaches the
gateway: the rebuilt run then answers a repeat of such a ``seq_id`` from the record, as the applied operation
it is (never applying it twice, never refusing it as behind). The answer of an operation answered before the
previous snapshot is not recorded: it reached the gateway long before, unless the gateway lost it too.

After a restart, the gateway asks for the run again with ``CreateAdapterRequest.recover_from`` set: the
trainer rebuilds it from the snapshot and answers the ``next_seq_id`` it now expects; the gateway replays the
logged operations from there, in order. Each operation is then applied exactly once to the state that
survives, and the replayed results equal the originals bit for bit (invariant ops). A run whose snapshot is
missing (expired, swept) is not rebuilt at all: a fresh adapter in its place would silently lose its steps or
the state it started from, so the rebuild fails with ``FailedPrecondition`` naming the run and the snapshot.

A snapshot that cannot be written after an operation fails nothing: the operation has been applied, and
recovery replays from the previous snapshot instead. The one written at a run's creation must be written, or
the creation fails.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass, field

from lathe.trainer.intake import result_to_proto
from lathe.trainer.ops import Body, Load, OptimStep, Result, Save
from lathe.types import LoadWeightsResponse, OptimStepResponse, SaveWeightsResponse
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_from_proto, forward_backward_output_from_proto, receipt_from_proto

RECORD_FILE = "recovery.json"  # a Record: {"seq_id", "state", "answers": {seq_id: base64 of a pb.TrainerResult}}


@dataclass(slots=True)
class Record:
    """What a snapshot says besides the run's state (``recovery.json``)."""

    seq_id: int  # the seq_id of the operation the snapshot was taken after (0: at the run's creation)
    answers: dict[int, Result] = field(default_factory=dict)  # seq_id -> its answer, since the previous snapshot
    state: bool = True  # False: a fresh run's record at creation, no state files beside it

    def files(self) -> dict[str, bytes]:
        answers = {str(s): base64.b64encode(result_to_proto(r).SerializeToString()).decode()
                   for s, r in sorted(self.answers.items())}
        return {RECORD_FILE: json.dumps({"seq_id": self.seq_id, "state": self.state, "answers": answers}).encode()}

    @classmethod
    def read(cls, files: dict[str, bytes]) -> Record:
        """The record of a snapshot's ``files`` (one written before answers were recorded has none)."""
        doc = json.loads(files[RECORD_FILE])
        answers = {int(s): _answer(pb.TrainerResult.FromString(base64.b64decode(a)))
                   for s, a in doc.get("answers", {}).items()}
        return cls(int(doc["seq_id"]), answers, bool(doc.get("state", True)))


def _answer(msg: pb.TrainerResult) -> Result:
    """The ``Result`` that ``intake.result_to_proto`` turned into ``msg`` (it turns this one into ``msg`` again)."""
    receipt = receipt_from_proto(msg.receipt) if msg.HasField("receipt") else None
    res = Result(receipt=receipt, recovery_path=msg.receipt.recovery_path)
    kind = msg.WhichOneof("result")
    if kind == "error":
        res.error = error_from_proto(msg.error)
    elif kind == "forward_backward":
        res.output = forward_backward_output_from_proto(msg.forward_backward)
    elif kind == "optim_step":
        res.output = OptimStepResponse(dict(msg.optim_step.metrics))
    elif kind == "save":
        res.output = SaveWeightsResponse(msg.save.path)
    else:
        res.output = LoadWeightsResponse(msg.load.path, msg.load.model_id)
    return res


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    every_steps: int = 10
    """write a run's recovery snapshot every this many optimizer steps (0: only at saves and every_ops)"""
    every_ops: int = 64
    """and after this many seq_ids since the last one due, whatever they were (0: never): a run that never steps
    (forward only) or steps rarely lets go of its logged operations too, and its rebuild replays few"""
    ttl_s: int = 30 * 24 * 3600
    """how long a snapshot is kept after its last write"""
    stagger: bool = True
    """offset each run's snapshot steps by its model id (0 .. every_steps - 1), so runs stepping together (a
    pool's tenants in one cycle) do not all write after the same cycle; off: at multiples of every_steps"""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.every_ops < 0:
            raise ValueError(f"snapshot every_steps and every_ops must be >= 0, got {self.every_steps} and "
                             f"{self.every_ops}")
        if self.ttl_s < 1:
            raise ValueError(f"snapshot ttl_s must be >= 1, got {self.ttl_s}")

    def due(self, body: Body, step_after: int, since: int, model_id: str) -> bool:
        """Is a snapshot due right after a successful operation ``body`` of run ``model_id`` that left its adapter at
        ``step_after``, ``since`` seq_ids after the last one that was due (written or not)?"""
        if (isinstance(body, Save) and body.kind == "weights") or isinstance(body, Load) or 0 < self.every_ops <= since:
            return True
        if not isinstance(body, OptimStep) or self.every_steps == 0:
            return False
        offset = zlib.crc32(model_id.encode()) % self.every_steps if self.stagger else 0
        return (step_after + offset) % self.every_steps == 0
