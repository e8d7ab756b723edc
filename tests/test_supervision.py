"""Supervision of the embedded stack, across real processes: a service killed with SIGKILL in the middle of
an SDK loop is started again on its own address and the loop finishes without catching anything, with the
results of an uninterrupted run (final weights and logprobs bit for bit, sampled tokens with a fixed seed);
past its restart budget the stack stops itself and says why; ``kill`` and ``restart`` by hand keep the
address. Each kill test prints what the kill cost (seconds from the kill to the loop's next result)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import lathe
from lathe.runtime.internal_auth import TOKEN_ENV, TOKEN_FILE_ENV
from lathe.stack import Stack, StackConfig
from tests.test_e2e_sft import logprobs, sft_batch

BASE = "lathe/tiny-llama"
STEPS, SAVE_EVERY = 7, 3
PROMPT = lathe.ModelInput.from_ints([5, 17, 42, 99, 3, 64])


def config(tmp_path: Path, model_cache: Path, **kw: object) -> StackConfig:
    kw = {"http_port": -1, **kw}
    return StackConfig(models=BASE, store_root=tmp_path / "store", cache_root=model_cache, trainer_threads=1,
                       sampler_threads=1, **kw)


def wait_for(done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.05)


@dataclass
class Run:
    losses: list[float]
    logprobs: list[np.ndarray]
    final: str  # the path of the last save_state
    kill_cost_s: float | None = None  # from the kill to the loop's next result


def sft_loop(sc: lathe.ServiceClient, stack: Stack, kill: str | None = None) -> Run:
    """forward_backward + optim_step, save_state every SAVE_EVERY steps; ``kill`` dies just before the first."""
    data = sft_batch(seed=4)
    tc = sc.create_lora_training_client(BASE, rank=4, seed=3)
    losses, cost, killed_at = [], None, 0.0
    for step in range(1, STEPS + 1):
        fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(lathe.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
        if step % SAVE_EVERY == 0:
            if kill and step == SAVE_EVERY:
                killed_at = time.monotonic()
                stack.kill(kill)
            tc.save_state(f"step-{step}").result()
            if kill and cost is None:
                cost = time.monotonic() - killed_at
    final = tc.save_state("final").result().path
    return Run(losses, logprobs(tc.forward(data, "cross_entropy").result()), final, cost)


@pytest.fixture
def internal_token(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Stack], None]]:
    """Lets this process call the stack's internal services, as its own children do."""
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    yield lambda stack: monkeypatch.setenv(TOKEN_ENV, stack.internal_token)


def test_checkpoints_killed_mid_training_is_restarted_and_the_run_ends_bit_for_bit(
        tmp_path: Path, model_cache: Path, tiny_dir: Path, internal_token: Callable[[Stack], None]) -> None:
    from lathe.checkpoints.client import CheckpointsClient

    lines: list[str] = []
    keys = tmp_path / "keys"
    keys.write_text("tml-sup=alice\n")
    with Stack(config(tmp_path, model_cache, restart_budget=1, api_keys_file=keys), say=lines.append) as stack, \
            lathe.ServiceClient(base_url=stack.gateway, api_key="tml-sup") as sc:
        internal_token(stack)
        address = stack.service("checkpoints").address
        ref = sft_loop(sc, stack)
        got = sft_loop(sc, stack, kill="checkpoints")
        assert lines == [f"checkpoints exited with code -9; restarted on {address} (1/1)"]
        assert got.losses == ref.losses
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert np.array_equal(a, b)
        with CheckpointsClient(address) as ckpt:
            weights = {p: ckpt.get(tenant="alice", path=p) for p in (ref.final, got.final)}
            saved = [c.name for c in ckpt.list(tenant="alice", run_id=got.final.split("/")[2]).checkpoints
                     if c.kind == "weights"]
        assert weights[got.final] == weights[ref.final]  # adapter and optimizer state, byte for byte
        assert saved == [f"step-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)] + ["final"]
        print(f"\ncheckpoints kill -9 before a save_state: {got.kill_cost_s:.2f} s to the save's result")

        procs = [s.proc for s in stack.services]
        stack.kill("checkpoints")  # a second crash within the window: past the budget of 1
        wait_for(lambda: stack.failure is not None, "giving up")
        assert stack.failure == ("checkpoints exited with code -9 after 1 restart(s) in 600 s (the budget is 1); "
                                 "stopping the stack")
        wait_for(lambda: all(p is not None and p.poll() is not None for p in procs), "stopping every child")
    assert lines[1:] == [stack.failure]


def test_sampler_killed_mid_sampling_is_restarted_and_seeded_samples_are_unchanged(
        tmp_path: Path, model_cache: Path, tiny_dir: Path) -> None:
    def sample_loop(sampler: lathe.SamplingClient, kill: bool) -> tuple[list, float | None]:
        out, cost, killed_at = [], None, 0.0
        for i in range(6):
            if kill and i == 3:
                killed_at = time.monotonic()
                stack.kill("sampler")
            res = sampler.sample(PROMPT, 2, lathe.SamplingParams(max_tokens=8, seed=100 + i, stop=[])).result()
            if kill and i == 3:
                cost = time.monotonic() - killed_at
            out.append([(s.tokens, s.logprobs) for s in res.sequences])
        return out, cost

    lines: list[str] = []
    with Stack(config(tmp_path, model_cache), say=lines.append) as stack, \
            lathe.ServiceClient(base_url=stack.gateway, api_key="tml-sup") as sc:
        address = stack.service("sampler").address
        tc = sc.create_lora_training_client(BASE, rank=4, seed=5)
        for _ in range(2):
            tc.forward_backward(sft_batch(seed=6), "cross_entropy")
            tc.optim_step(lathe.AdamParams(learning_rate=1e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client("policy")
        ref, _ = sample_loop(sampler, kill=False)
        got, cost = sample_loop(sampler, kill=True)
        assert got == ref
        assert len({tuple(seqs[0][0]) for seqs in ref}) > 1  # the seeds matter: not one answer for all
        print(f"\nsampler kill -9 before a sample: {cost:.2f} s to the sample's result")
    assert lines == [f"sampler exited with code -9; restarted on {address} (1/3)"]  # and stop() was no crash


def test_kill_and_restart_by_hand_keep_the_gateway_address(tmp_path: Path, model_cache: Path, tiny_dir: Path) -> None:
    lines: list[str] = []
    with Stack(config(tmp_path, model_cache, supervise=False, http_port=0), say=lines.append) as stack:
        gateway, http = stack.gateway, stack.http_url
        assert stack.kill("gateway") == -9
        time.sleep(0.5)  # unsupervised: nothing starts it again
        assert not stack.service("gateway").running
        assert stack.restart("gateway") == gateway
        assert stack.restart("gateway") == gateway  # a running child is left as it is
        assert stack.http_url == http
        with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-sup") as sc:
            assert BASE in [m.model_name for m in sc.get_server_capabilities().supported_models]
    assert lines == []
