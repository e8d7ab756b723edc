"""kill -9 of the gateway or of the trainer in the middle of a training loop, through Lathe's SDK (gRPC) and the
official ``tinker`` SDK (HTTP): the loop completes without the user's code catching anything, and the weights it
ends with equal an uninterrupted run's bit for bit. A gateway restarts on the same ports over the same
control-plane database; a trainer restarts empty, and the gateway rebuilds each run there from its recovery
snapshot (here every 2 optimizer steps) and the logged operations after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import tinker

import lathe
from lathe.stack import Stack, StackConfig
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
STEPS = 8
KILL_AFTER = 3  # steps done before the kill


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("cp-restart")
    cfg = StackConfig(models=BASE, store_root=root / "store", cache_root=model_cache, trainer_threads=1,
                      sampler_threads=1, db_url=f"sqlite:///{root}/control.db",
                      trainer_args=("--snapshot-every", "2"))
    with Stack(cfg) as s:
        yield s


def batch(n: int = 4) -> list[tuple[list[int], list[float]]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        toks = [int(t) for t in rng.integers(3, 250, size=12 + 2 * i)]
        out.append((toks, [0.0] * 3 + [1.0] * (len(toks) - 4)))  # one weight per target
    return out


def train(tc: lathe.TrainingClient | tinker.TrainingClient, sdk: ModuleType, data: list,
          progress: Callable[[int], None]) -> list:
    """``STEPS`` steps of ``tc`` (either SDK: ``sdk`` is its module) on ``data``, ``progress`` told after each; the
    final forward's loss outputs."""
    for i in range(STEPS):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(sdk.AdamParams(learning_rate=1e-2))
        fb.result()
        opt.result()
        progress(i + 1)
    return tc.forward(data, "cross_entropy").result().loss_fn_outputs


def lathe_loop(stack: Stack, tag: str, progress: Callable[[int], None]) -> list[np.ndarray]:
    data = [next_token_datum(t, lathe, w) for t, w in batch()]
    with lathe.ServiceClient(base_url=stack.gateway, api_key=f"tml-{tag}") as sc:
        outputs = train(sc.create_lora_training_client(BASE, rank=4, seed=5), lathe, data, progress)
    return [o["logprobs"].to_numpy() for o in outputs]


def tinker_loop(stack: Stack, tag: str, progress: Callable[[int], None]) -> list[np.ndarray]:
    data = [next_token_datum(t, tinker, w) for t, w in batch()]
    with tinker.ServiceClient(base_url=stack.http_url, api_key=f"tml-{tag}") as sc:  # its heartbeats end with it
        outputs = train(sc.create_lora_training_client(BASE, rank=4, seed=5).result(), tinker, data, progress)
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float32) for o in outputs]


def interrupted(stack: Stack, loop: Callable[[Stack, str, Callable[[int], None]], list[np.ndarray]],
                tag: str, service: str) -> tuple[list[np.ndarray], float]:
    """Run ``loop`` in a thread, SIGKILL ``service`` after ``KILL_AFTER`` steps and start it again; returns what
    the loop returned and the seconds from the kill to the loop's next finished step."""
    reached = threading.Event()
    steps: list[tuple[int, float]] = []
    box: dict[str, object] = {}

    def progress(done: int) -> None:
        steps.append((done, time.monotonic()))
        if done == KILL_AFTER:
            reached.set()

    def body() -> None:
        try:
            box["out"] = loop(stack, tag, progress)
        except BaseException as e:  # noqa: BLE001 - reported below as the test's failure
            box["err"] = e

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    assert reached.wait(300), box.get("err")
    killed_at = time.monotonic()
    stack.kill(service)
    stack.restart(service)
    worker.join(300)
    assert not worker.is_alive(), f"the loop did not finish after the {service} came back"
    assert "err" not in box, f"the user's loop raised {box.get('err')!r}"
    after = [t for n, t in steps if n > KILL_AFTER]
    assert [n for n, _ in steps] == list(range(1, STEPS + 1))
    return box["out"], after[0] - killed_at  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize(("service", "loop"), [("gateway", lathe_loop), ("gateway", tinker_loop),
                                               ("trainer", lathe_loop), ("trainer", tinker_loop)],
                         ids=["gateway-lathe-grpc", "gateway-tinker-http", "trainer-lathe-grpc", "trainer-tinker-http"])
def test_a_kill_costs_time_not_steps(stack: Stack, service: str, loop: Callable,
                                     capsys: pytest.CaptureFixture) -> None:
    reference = loop(stack, f"ref-{service}-{loop.__name__}", lambda done: None)
    got, cost_s = interrupted(stack, loop, f"kill-{service}-{loop.__name__}", service)
    assert len(got) == len(reference)
    for a, b in zip(reference, got, strict=True):
        assert np.array_equal(a, b)  # bit for bit: no step lost, none applied twice
    with capsys.disabled():
        print(f"\n{loop.__name__}: {service} kill -9 -> next step done after {cost_s:.2f} s")


def test_an_inflight_client_follows_its_run_across_a_gateway_restart(stack: Stack) -> None:
    """The run's inflight weights and the run each inflight session follows live in the control database: after a
    kill -9 of the gateway, a client made before it samples the weights of an inflight save made after it."""
    with tinker.ServiceClient(base_url=stack.http_url, api_key="tml-inflight-restart") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=5).result()
        client = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        probe = tinker.ModelInput.from_ints([t for t, _ in batch(1)][0])
        before = client.compute_logprobs(probe).result()
        stack.kill("gateway")
        stack.restart("gateway")
        (tokens, weights), = batch(1)
        tc.forward_backward([next_token_datum(tokens, tinker, weights)], "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
        after = tc.save_weights_and_get_sampling_client(kind="inflight").result().compute_logprobs(probe).result()
        assert after != before
        assert client.compute_logprobs(probe).result() == after
