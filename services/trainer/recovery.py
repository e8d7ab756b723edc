"""Recovery snapshots: what a restarted trainer rebuilds a training run from.

A trainer keeps every run's adapter in memory, so a crash (``kill -9``, an OOM kill, a lost node) loses
them. The classic answer is a write-ahead log plus checkpoints, split between two rooms:

- the gateway's ledger holds every acknowledged operation's request (the log);
- the trainer writes a **recovery snapshot** of a run right after applying some of its operations: every
  ``every_steps``-th optimizer step and every training-state save. A snapshot is the run's whole state at
  that point, in the paging format (LoRA weights, AdamW moments, step and the gradients accumulated but not
  yet applied), stored through the checkpoints service at ``tinker://<run>/recovery/latest`` (overwritten in
  place; it expires ``ttl_s`` after its last write, so an abandoned run's snapshot goes away).

A run created from a saved training state gets a snapshot at once (seq_id 0), so that recovery never needs
the state it started from. The snapshot carries the ``seq_id`` it was taken after (``recovery.json``), and the
operation's receipt names it too (the gateway keeps the logged operations after it).

After a restart, the gateway asks for the run again with ``CreateAdapterRequest.recover_from`` set: the
trainer rebuilds it from the snapshot (or, if the run never had one, creates it as at first: a fresh
adapter's initialization is a deterministic function of its LoRA config and model id) and answers the
``next_seq_id`` it now expects; the gateway replays the logged operations from there, in order. Each
operation is then applied exactly once to the state that survives, and the replayed results equal the
originals bit for bit (invariant ops).

A snapshot that cannot be written fails nothing: the operation has been applied, and recovery replays
from the previous snapshot instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lathe.trainer.ops import Body, OptimStep, Save

SEQ_FILE = "recovery.json"  # {"seq_id": the seq_id of the operation the snapshot was taken after}


def seq_file(seq_id: int) -> dict[str, bytes]:
    return {SEQ_FILE: json.dumps({"seq_id": seq_id}).encode()}


def snapshot_seq(files: dict[str, bytes]) -> int:
    """The seq_id a snapshot was taken after (0: at the run's creation)."""
    return int(json.loads(files[SEQ_FILE])["seq_id"])


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    every_steps: int = 10  # a snapshot after every this many optimizer steps (0: only at saves)
    ttl_s: int = 30 * 24 * 3600

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"snapshot every_steps must be >= 0, got {self.every_steps}")
        if self.ttl_s < 1:
            raise ValueError(f"snapshot ttl_s must be >= 1, got {self.ttl_s}")

    def due(self, body: Body, step_after: int) -> bool:
        """Is a snapshot due right after a successful operation ``body`` that left the adapter at ``step_after``?"""
        if isinstance(body, Save):
            return body.kind == "weights"
        return isinstance(body, OptimStep) and self.every_steps > 0 and step_after % self.every_steps == 0
