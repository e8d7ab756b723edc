"""Trainer pools of several ranks (gloo on CPU): a 2-rank pool answers and trains exactly as a pool of one; a
rank killed mid-run costs no acknowledged step; a pool that cannot form says why, in bounded time.

The exactness test leads the pool from this process (an in-process ``TrainerEngine`` as rank 0, so its adapters
can be read) with rank 1 a real ``python -m lathe.trainer --rank 1`` process; the kill test runs the whole
stack with ``trainer_ranks=2`` and an SDK loop against it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import lathe
from lathe.models.catalog import ModelCatalog
from lathe.runtime.probes import SERVING
from lathe.stack import Stack, StackConfig
from lathe.trainer.dist import EXIT_BAD_POOL, EXIT_RANK_LOST, PoolConfig, free_port, join
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.shard import assign
from lathe.v1 import lathe_pb2 as pb
from tests.test_e2e_sft import logprobs, sft_batch
from tests.test_health import wait_for
from tests.test_trainer_engine import BASE, batch, fb, opt, submit, weights
from tests.test_trainer_recovery import ServiceStore

LORAS = {"a": pb.LoraConfig(rank=4, seed=1, train_attn=True, train_mlp=True, train_unembed=True),
         "b": pb.LoraConfig(rank=2, seed=2, train_attn=True, train_mlp=False, train_unembed=False),
         "c": pb.LoraConfig(rank=8, seed=3, train_attn=False, train_mlp=True, train_unembed=True)}
CYCLE_TOKENS = 64  # small: the 12-datum request of "c" is split over cycles, the others share them


def forward(model_id: str, seq: int, data: list[pb.Datum]) -> pb.TrainerOp:
    op = fb(model_id, seq, data)
    op.forward_backward.forward_only = True
    return op


def load(model_id: str, seq: int, path: str) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", request_id=f"r{seq}",
                        load=pb.LoadRequest(model_id=model_id, seq_id=seq, path=path, with_optimizer=True))


def save(model_id: str, seq: int, name: str) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", request_id=f"r{seq}",
                        save=pb.SaveRequest(model_id=model_id, seq_id=seq, name=name, kind="weights"))


def workload() -> list[pb.TrainerOp]:
    """Three tenants' runs, uneven: fb+optim pairs of 1..5 datums, a forward, a save and a load of it, and one
    request larger than a cycle (accumulated over several cycles on whichever ranks own it)."""
    a = [fb("a", 1, batch(1, 5)), opt("a", 2), fb("a", 3, batch(2, 1)), opt("a", 4), save("a", 5, "s5"),
         fb("a", 6, batch(3, 4)), opt("a", 7), load("a", 8, "tinker://a/weights/s5"), fb("a", 9, batch(4, 2)),
         opt("a", 10)]
    b = [fb("b", 1, batch(11, 2)), opt("b", 2), forward("b", 3, batch(12, 3)), fb("b", 4, batch(13, 3)),
         opt("b", 5), fb("b", 6, batch(14, 1)), opt("b", 7)]
    c = [fb("c", 1, batch(21, 3)), opt("c", 2), fb("c", 3, batch(22, 12)), opt("c", 4), fb("c", 5, batch(23, 2)),
         opt("c", 6)]
    return a + b + c


def run_pool(engine: TrainerEngine) -> tuple[list[pb.TrainerResult], dict[str, dict[str, bytes]]]:
    """Queue the whole workload before the cycle thread starts (so cycles are composed the same way), run it,
    and return every result and every run's final weights as bytes."""
    for model_id, lora in LORAS.items():
        engine.create_adapter(pb.CreateAdapterRequest(model_id=model_id, tenant="t", base_model=BASE, lora_config=lora))
    futures = [submit(engine, op) for op in workload()]
    engine.start()
    results = [f.result(timeout=300) for f in futures]
    final = {m: {k: v.numpy().tobytes() for k, v in weights(engine, m).items()} for m in LORAS}
    return results, final


def engine_config(model_cache: Path, tmp: Path) -> TrainerConfig:
    return TrainerConfig(models=BASE, cache_root=model_cache, cycle_tokens=CYCLE_TOKENS, page_store=str(tmp / "pages"))


def test_assign_is_balanced_by_tokens_and_deterministic() -> None:
    assert assign([10, 50, 20, 30], 2) == [0, 0, 1, 1]  # largest first: 50->0, 30->1, 20->1, 10->0 (a 50/50 tie)
    assert assign([5, 5, 5], 1) == [0, 0, 0]
    assert assign([], 3) == []


def test_two_ranks_train_bit_for_bit_like_one(model_cache: Path, tiny_dir: Path, tmp_path: Path) -> None:
    solo = TrainerEngine(engine_config(model_cache, tmp_path / "solo"), ModelCatalog.from_spec(BASE, model_cache),
                         ServiceStore(tmp_path / "solo-store"))
    try:
        expected, expected_weights = run_pool(solo)
    finally:
        solo.stop()
    assert all(r.WhichOneof("result") != "error" for r in expected), [r.error.message for r in expected]

    pool = PoolConfig(world_size=2, rank=0, master_port=free_port(), timeout_s=60)
    follower = subprocess.Popen([sys.executable, "-m", "lathe.trainer", "--models", BASE, "--cache-root",
                                 str(model_cache), "--threads", "1", "--cycle-tokens", str(CYCLE_TOKENS),
                                 "--page-store", str(tmp_path / "pages"), "--world-size", "2", "--rank", "1",
                                 "--master-port", str(pool.master_port), "--port", "0", "--dtype", "float32"],
                                stdout=subprocess.PIPE, text=True)
    try:
        group = join(pool, "cpu", "float32")
        # a follower serves only gRPC health, so its pod's probes see it: SERVING once it joined the pool
        ready = None
        for _ in range(20):  # bounded: the "listening on" line is among its first few lines
            if ready := re.search(r"listening on (\S+)", follower.stdout.readline()):
                break
        assert ready, "the follower did not say where it serves health"
        wait_for(ready.group(1), SERVING)
    except BaseException:
        follower.kill()
        raise
    lead = TrainerEngine(engine_config(model_cache, tmp_path / "lead"), ModelCatalog.from_spec(BASE, model_cache),
                         ServiceStore(tmp_path / "lead-store"), group)
    try:
        got, got_weights = run_pool(lead)
    finally:
        lead.stop()  # tells the follower to stop
        assert follower.wait(timeout=60) == 0
        group.close()

    assert all(r.WhichOneof("result") != "error" for r in got), [r.error.message for r in got]
    cycles = [r.receipt.cycle for r in got]
    assert max(cycles) >= 10 and len(set(cycles)) < len(cycles)  # >= 10 cycles, some shared by several runs
    for want, have in zip(expected, got, strict=True):
        assert want.WhichOneof("result") == have.WhichOneof("result")
        if want.HasField("forward_backward"):  # loss, metrics and every datum's logprobs, bit for bit
            assert want.forward_backward.SerializeToString(deterministic=True) == \
                have.forward_backward.SerializeToString(deterministic=True)
            assert want.forward_backward.metrics["loss:sum"] > 0
        assert want.receipt.adapter_step == have.receipt.adapter_step
    assert got_weights == expected_weights  # every run's adapter, byte for byte
    assert group.seconds["all_gather"] > 0  # gradients did cross between the ranks


# ---- a rank killed mid-run, under the whole stack ----

STEPS = 6


def rank_pids(stack: Stack) -> dict[int, int]:
    found = (re.fullmatch(r"lathe\.trainer rank (\d+) pid (\d+)", line) for line in stack.service("trainer").lines)
    return {int(m[1]): int(m[2]) for m in found if m}


def sft_loop(sc: lathe.ServiceClient, kill_rank1: Stack | None = None) -> tuple[list[float], np.ndarray, float]:
    """fb + optim_step STEPS times (rank 1 of the pool SIGKILLed after the third); the losses, the final
    logprobs, and the seconds from the kill to the loop's next result."""
    data = sft_batch(seed=8)
    tc = sc.create_lora_training_client(BASE, rank=4, seed=9)
    losses, cost = [], 0.0
    for step in range(1, STEPS + 1):
        fb_, opt_ = tc.forward_backward(data, "cross_entropy"), tc.optim_step(lathe.AdamParams(learning_rate=5e-3))
        killed = 0.0
        if kill_rank1 is not None and step == 4:
            killed = time.monotonic()
            os.kill(rank_pids(kill_rank1)[1], signal.SIGKILL)
        losses.append(fb_.result().metrics["loss:sum"])
        opt_.result()
        cost = time.monotonic() - killed if killed else cost
    return losses, logprobs(tc.forward(data, "cross_entropy").result())[0], cost


@pytest.fixture()
def pool_stack(tmp_path: Path, model_cache: Path, tiny_dir: Path) -> Iterator[tuple[Stack, list[str]]]:
    lines: list[str] = []
    cfg = StackConfig(models=BASE, store_root=tmp_path / "store", cache_root=model_cache, trainer_threads=1,
                      sampler_threads=1, http_port=-1, trainer_ranks=2,
                      trainer_args=("--rank-timeout-s", "20", "--snapshot-every", "2"), log_dir=tmp_path / "logs")
    with Stack(cfg, say=lines.append) as stack:
        yield stack, lines


def test_killing_rank_1_mid_run_loses_no_step(pool_stack: tuple[Stack, list[str]]) -> None:
    stack, lines = pool_stack
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-ranks") as sc:
        ref = sft_loop(sc)
        first_leader = stack.service("trainer").proc.pid
        got = sft_loop(sc, kill_rank1=stack)
    # the leader answered the in-flight operations UNAVAILABLE and left with the pool's exit code; the stack
    # started the pool again, the gateway retried on it and rebuilt the run from its snapshot and ledger
    assert lines[0].startswith(f"trainer exited with code {EXIT_RANK_LOST}; restarted on"), lines
    assert stack.service("trainer").proc.pid != first_leader
    log = (stack.cfg.log_dir / "trainer.log").read_text()
    assert re.search(r"trainer pool: \w+ failed on rank 0 of 2 \(timeout 20 s\): .*the pool is re-forming, retry", log)
    assert got[0] == ref[0]
    assert np.array_equal(got[1], ref[1])  # the final weights' logprobs, bit for bit
    print(f"\nrank 1 kill -9: {got[2]:.1f} s from the kill to the next result")


# ---- a pool that cannot form ----

def trainer_rank(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lathe.trainer", "--models", BASE, "--threads", "1", "--port", "0",
                             *flags],
                            stderr=subprocess.PIPE, text=True)


def test_an_unreachable_leader_fails_in_bounded_time_naming_it(tiny_dir: Path) -> None:
    port = free_port()
    proc = trainer_rank("--world-size", "2", "--rank", "1", "--master-port", str(port), "--rank-timeout-s", "2")
    _, err = proc.communicate(timeout=60)  # bounded: it gives up on its own
    assert proc.returncode == EXIT_RANK_LOST
    assert f"trainer rank 1: could not reach the pool's leader (rank 0) at 127.0.0.1:{port} within 2 s" in err


@pytest.mark.parametrize(("lead", "follow", "said"), [
    (("--world-size", "2"), ("--world-size", "3"),
     "world size mismatch in the pool at 127.0.0.1:{port}: rank 1 was started with world_size 3, rank 0 with 2"),
    # ranks resolve --dtype auto each on its own device: unlike dtypes would compute unlike bits
    (("--world-size", "2", "--dtype", "float32"), ("--world-size", "2", "--dtype", "bfloat16"),
     "dtype mismatch in the pool at 127.0.0.1:{port}: rank 1 holds its base weights in bfloat16, rank 0 in float32"),
], ids=["world-size", "dtype"])
def test_ranks_that_disagree_both_say_so(tiny_dir: Path, lead: tuple[str, ...], follow: tuple[str, ...],
                                         said: str) -> None:
    port = str(free_port())
    leader = trainer_rank(*lead, "--rank", "0", "--master-port", port, "--rank-timeout-s", "20")
    follower = trainer_rank(*follow, "--rank", "1", "--master-port", port, "--rank-timeout-s", "20")
    _, lead_err = leader.communicate(timeout=60)
    _, follow_err = follower.communicate(timeout=60)
    assert leader.returncode == EXIT_BAD_POOL
    assert "trainer rank 0: " + said.format(port=port) in lead_err
    assert follower.returncode in (EXIT_BAD_POOL, EXIT_RANK_LOST)  # it may find the leader gone already
    assert "trainer rank 1: " in follow_err


def test_a_rank_outside_the_world_is_refused_at_the_command_line() -> None:
    proc = trainer_rank("--world-size", "2", "--rank", "2", "--master-port", "29999")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "rank 2 is outside a pool of world_size 2 (0...1)" in err
