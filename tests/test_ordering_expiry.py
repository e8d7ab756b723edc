"""A run's ordered operations when one seq_id never comes.

Protects: operations waiting for a missing seq_id fail after the trainer's ``order_wait_s`` with an error
naming the seq_id they waited for, nothing behind the hole is applied, and the run goes on from the next
seq_id (a late arrival of the missing one is refused); a seq_id the gateway refused at its door is passed
over at once, so through the official tinker SDK an invalid ``optim_step`` raises and the next
forward_backward + optim_step complete with the weights of a run that never sent it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch

from lathe.errors import FailedPrecondition
from lathe.models.catalog import ModelCatalog
from lathe.stack import Stack
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.order import Sequencer
from lathe.v1 import lathe_pb2 as pb
from tests.test_tinker_sdk import sft_data
from tests.test_trainer_engine import BASE, batch, fb, opt, submit, weights

torch.set_num_threads(1)
WAIT_S = 1.0  # the trainer's order_wait_s in these tests


def skip(model_id: str, seq: int) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", skip=pb.SkipRequest(reason="eps = 0 must be > 0"))


def error(fut: Future) -> pb.Error:
    res = fut.result(timeout=60)
    assert res.WhichOneof("result") == "error", res
    return res.error


@pytest.fixture()
def engine(model_cache: Path, tiny_dir: Path) -> Iterator[TrainerEngine]:
    eng = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache, order_wait_s=WAIT_S),
                        ModelCatalog.from_spec(BASE, model_cache))
    eng.start()
    eng.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE, lora_config=pb.LoraConfig(
        rank=4, seed=7, train_attn=True, train_mlp=True, train_unembed=True)))
    yield eng
    eng.stop()


def test_the_sequencer_passes_over_skips_and_gives_up_on_a_hole() -> None:
    seq = Sequencer(reached=0.0)
    three, _ = seq.offer(3, "op3", now=10.0)
    assert seq.skip(2, "refused", now=11.0).result() == "refused"
    assert seq.peek() is None and seq.stalled_since() == 10.0  # still waiting for 1
    assert seq.skip(1, "refused", now=12.0).result() == "refused"
    assert seq.peek().op == "op3" and seq.pop(now=13.0).future is three and seq.next_seq == 4
    # a skip with nothing behind it yet: a corrected operation under its seq_id takes its place
    refused = seq.skip(4, "refused", now=14.0)
    assert seq.peek() is None and seq.stalled_since() is None
    corrected, new = seq.offer(4, "op4", now=15.0)
    assert new and corrected is not refused and seq.pop(now=16.0).op == "op4"
    seq.offer(6, "op6", now=20.0)
    seq.offer(7, "op7", now=25.0)
    seq.skip(8, "refused", now=26.0)
    failed = seq.give_up(now=320.0)
    assert [(item.op, reason) for item, reason in failed] == [
        ("op6", "seq_id 6 waited 300 s for seq_id 5, which never arrived (operations of a run are applied strictly "
                "in seq_id order)"),
        ("op7", "seq_id 7 waited 295 s for seq_id 5, which never arrived (operations of a run are applied strictly "
                "in seq_id order)")]
    assert seq.next_seq == 9 and seq.stalled_since() is None
    assert seq.skip(7, "refused", now=321.0) is failed[1][0].future  # a repeat keeps the first answer
    with pytest.raises(FailedPrecondition, match="seq_id 5 is behind this run's next seq_id 9"):
        seq.offer(5, "late", now=330.0)


def test_operations_behind_a_missing_seq_id_fail_after_the_wait_and_the_run_goes_on(engine: TrainerEngine) -> None:
    before = weights(engine, "m")
    behind = [submit(engine, fb("m", 2, batch(0))), submit(engine, opt("m", 3))]  # seq_id 1 never comes
    for seq, fut in zip((2, 3), behind, strict=True):
        err = error(fut)
        assert err.code == "FailedPrecondition"
        assert re.fullmatch(rf"seq_id {seq} waited \d+ s for seq_id 1, which never arrived \(operations of a run "
                            r"are applied strictly in seq_id order\)", err.message), err.message
    assert engine.bank.get("m").step == 0
    assert all(torch.equal(before[k], v) for k, v in weights(engine, "m").items())  # nothing was applied
    assert submit(engine, fb("m", 2, batch(0))).result(timeout=60) == behind[0].result()  # a retry: the same answer
    with pytest.raises(FailedPrecondition, match="seq_id 1 is behind this run's next seq_id 4"):
        submit(engine, fb("m", 1, batch(0)))  # the missing one, too late
    assert submit(engine, fb("m", 4, batch(1))).result(timeout=60).WhichOneof("result") == "forward_backward"
    assert submit(engine, opt("m", 5)).result(timeout=60).receipt.adapter_step == 1


def test_a_skipped_seq_id_lets_the_next_ones_run_at_once(engine: TrainerEngine) -> None:
    refused = submit(engine, skip("m", 1))
    assert error(refused).message == "seq_id 1 was refused by the gateway: eps = 0 must be > 0"
    corrected = submit(engine, fb("m", 1, batch(0)))  # nothing behind the skip yet: this takes its place
    assert corrected.result(timeout=60).WhichOneof("result") == "forward_backward"
    submit(engine, skip("m", 2))
    behind = submit(engine, opt("m", 3))
    assert behind.result(timeout=60).receipt.adapter_step == 1  # not failed after the 1 s wait: run at once
    assert error(submit(engine, opt("m", 2))).message == "seq_id 2 was refused by the gateway: eps = 0 must be > 0"


def test_an_optim_step_refused_at_the_door_does_not_hold_the_run(stack: Stack) -> None:
    """Through the official SDK: the refused seq_id raises, the run goes on at once (its trainer waits 300 s
    for a missing seq_id), and its weights equal those of a run that never sent the refused step."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-skip")
    refused_run = sc.create_lora_training_client(BASE, rank=4, seed=3).result()
    clean_run = sc.create_lora_training_client(BASE, rank=4, seed=3).result()
    with pytest.raises(tinker.BadRequestError, match="eps"):
        refused_run.optim_step(tinker.AdamParams(learning_rate=0.05, eps=0.0)).result()
    for tc in (refused_run, clean_run):
        fb_future = tc.forward_backward(sft_data(tinker), "cross_entropy")
        tc.optim_step(tinker.AdamParams(learning_rate=0.05)).result(timeout=60)
        fb_future.result(timeout=60)
    probe = sft_data(tinker, seed=5)
    got, want = (tc.forward(probe, "cross_entropy").result(timeout=60) for tc in (refused_run, clean_run))
    for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        assert np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    sc.close("success").result()
