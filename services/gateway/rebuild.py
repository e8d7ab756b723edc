"""Rebuilding a run on a trainer that lost it (it restarted): from the run's recovery snapshot and the operations
the ledger logged after it (``lathe.trainer.recovery``). Called by ``runs`` when an operation finds its run gone."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from lathe.errors import FailedPrecondition
from lathe.types import recovery_path
from lathe.v1 import lathe_pb2 as pb

from .calls import Caller
from .quotas import Quotas
from .records import Operation, Run
from .store import ControlStore

log = logging.getLogger("lathe.gateway")

REBUILD_ATTEMPTS = 3  # an operation finding its run gone from the trainer rebuilds it at most this often


def _replayed(run: Run, seq_id: int, rec: Operation | None) -> pb.TrainerOp:
    """What a rebuild sends again for ``seq_id`` of ``run``: its recorded request, or a skip for a seq_id refused at
    the door (no record) and for an answered save (it changed no state of the run, its answer stands, and saving
    again would bring back a checkpoint the user may have deleted since)."""
    if rec is not None and not (rec.kind == "save" and rec.state == "done"):
        return pb.TrainerOp.FromString(rec.request)
    reason = "refused at the door" if rec is None else "an answered save: not saved again"
    return pb.TrainerOp(model_id=run.model_id, seq_id=seq_id, tenant=run.tenant, skip=pb.SkipRequest(reason=reason))


async def rebuild(run: Run, seen: int, trainer: Any, caller: Caller, store: ControlStore, quotas: Quotas) -> None:
    """Recreate ``run`` on a trainer that lost it, from its recovery snapshot (a fresh run never snapshotted is
    made fresh again), then apply again, in order, every recorded operation from the ``seq_id`` the trainer now
    expects up to the last one answered; a ``seq_id`` refused at the door (no record) and an answered save are
    skipped (``_replayed``; a load is never replayed unless its snapshot failed: the trainer snapshots every
    load). The replayed results are dropped (the recorded ones stand); operations still pending are sent on by
    their own requests, and one the snapshot covers is answered from its record (``lathe.trainer.recovery``).
    A missing snapshot fails the rebuild, and so the operation, with the trainer's ``FailedPrecondition`` naming
    the run; so does a replayed operation that fails where it once succeeded (a load whose checkpoint is gone),
    naming the run and the operation: a run that silently skipped it would not be the run its answers describe.
    ``trainer``: the stub of the trainer serving the run. ``seen``: ``run.rebuilds`` when the caller found the run
    gone: if another request (or gateway: the trainer answers a live run as it is) rebuilt it since, nothing is done
    again."""
    async with run.rebuilding:
        if run.rebuilds != seen:
            return
        t0 = time.monotonic()
        info: pb.AdapterInfo = await caller.send(trainer.CreateAdapter, pb.CreateAdapterRequest(
            model_id=run.model_id, tenant=run.tenant, base_model=run.base_model, lora_config=run.lora,
            optimizer=run.optimizer, recover_from=recovery_path(run.model_id),
            max_resident_adapters=quotas.of(run.tenant).max_resident_adapters), work=True)
        logged = store.replay(run.model_id, info.next_seq_id)
        answered = max((op.seq_id for op in logged if op.state == "done"), default=info.next_seq_id - 1)
        recorded = {op.seq_id: op for op in logged if op.seq_id <= answered}
        ops = {seq_id: _replayed(run, seq_id, recorded.get(seq_id)) for seq_id in range(info.next_seq_id,
                                                                                        answered + 1)}
        results = await asyncio.gather(*(caller.send(trainer.Run, op, work=True) for op in ops.values()))
        for (seq_id, op), res in zip(ops.items(), results, strict=True):
            rec = recorded.get(seq_id)
            if res.HasField("error") and not op.HasField("skip") and rec is not None and rec.state == "done" \
                    and not pb.FutureResult.FromString(rec.result).HasField("error"):
                raise FailedPrecondition(
                    f"run {run.model_id!r} cannot be rebuilt as it was: replaying its {rec.kind} of seq_id "
                    f"{seq_id}, which succeeded, failed now ({res.error.code}: {res.error.message})")
        run.rebuilds += 1
        log.info("rebuilt %s on the trainer from seq_id %d (step %d): %d operations replayed in %.1f s",
                 run.model_id, info.next_seq_id, info.step, len(ops), time.monotonic() - t0)
