"""The sampler's admission across tenants and its running budget, in-process on the tiny model.

Protects: one tenant's backlog of a hundred requests does not starve another tenant's single request (it
completes among the first few, counted in completion order); a request reserving more than the pool's
running budget is refused with InvalidArgument naming its numbers before anything is fetched or queued;
requests that together exceed the budget run one after the other, and the budget is reported in the
pool's capabilities.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from lathe.models.catalog import ModelCatalog
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.v1 import lathe_pb2 as pb

torch.set_num_threads(1)
BASE = "lathe/tiny-llama"


def sample_request(tenant: str, prompt: list[int], n: int = 1, max_tokens: int = 2) -> pb.SampleRequest:
    return pb.SampleRequest(prompt=prompt, num_samples=n, tenant=tenant, base_model=BASE,
                            params=pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=3),
                            request_id=f"{tenant}-{len(prompt)}")


@pytest.fixture()
def engine(model_cache: Path, tiny_dir: Path) -> Iterator[Callable[..., SamplerEngine]]:
    """``engine(**config)``: an engine that is not started (the test runs its steps), stopped afterwards."""
    made: list[SamplerEngine] = []

    def make(**cfg: int) -> SamplerEngine:
        made.append(SamplerEngine(SamplerConfig(models=BASE, cache_root=model_cache, **cfg),
                                  ModelCatalog.from_spec(BASE, model_cache)))
        return made[-1]

    yield make
    for eng in made:
        eng.stop()


def settle(eng: SamplerEngine, waiting: int) -> None:
    """Wait until the loader threads have checked every request into the waiting line."""
    deadline = time.monotonic() + 60
    while eng.stats()["waiting"] < waiting:
        assert time.monotonic() < deadline, eng.stats()
        time.sleep(0.001)


def drain(eng: SamplerEngine, futures: list[Future]) -> None:
    deadline = time.monotonic() + 120
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, eng.stats()
        eng.step()


def test_a_single_request_is_not_starved_by_another_tenants_backlog(engine: Callable[..., SamplerEngine]) -> None:
    eng = engine(max_running=2)
    done: list[str] = []
    futures = []
    for i in range(100):
        futures.append(eng.sample(sample_request("alice", [3 + i % 50, 7, 9])))
    futures.append(eng.sample(sample_request("bob", [11, 12])))
    for f, who in zip(futures, ["alice"] * 100 + ["bob"], strict=True):
        f.add_done_callback(lambda f, who=who: done.append(who))
    settle(eng, 101)  # bob's request is the last of 101 in the line; first come, first served would run it last
    drain(eng, futures)
    assert all(f.result().WhichOneof("result") == "sample" for f in futures)
    assert len(done) == 101 and done.index("bob") < 3, done.index("bob")


def test_a_request_over_the_running_budget_is_refused_with_its_numbers(engine: Callable[..., SamplerEngine]) -> None:
    eng = engine(max_running_tokens=100)
    res = eng.sample(sample_request("alice", [5, 6, 7, 8, 9], n=4, max_tokens=30)).result(timeout=60)
    assert res.WhichOneof("result") == "error" and res.error.code == "InvalidArgument"
    assert res.error.message == ("num_samples (4) x (prompt (5 tokens) + max_tokens (30)) = 140 tokens is over this "
                                 "sampler pool's running budget of 100 tokens; ask for fewer samples or tokens")
    assert eng.stats() == {"queued": 0, "waiting": 0, "running": 0, "adapters": 0, "steps": 0}
    at_limit = eng.sample(sample_request("alice", [5, 6, 7, 8, 9], n=4, max_tokens=20))
    drain(eng, [at_limit])
    assert [len(s.tokens) for s in at_limit.result().sample.sequences] == [20] * 4
    assert eng.capabilities().limits.max_sample_tokens == 100


def test_requests_that_together_exceed_the_budget_run_one_after_the_other(engine: Callable[..., SamplerEngine]) -> None:
    eng = engine(max_running_tokens=100)
    first = eng.sample(sample_request("alice", [5, 6, 7], n=2, max_tokens=27))  # reserves 60 tokens
    second = eng.sample(sample_request("bob", [8, 9, 10], n=2, max_tokens=27))  # 60 more: over 100
    settle(eng, 2)
    eng.step()
    assert eng.stats()["running"] == 2 and eng.stats()["waiting"] == 1  # only the first was admitted
    drain(eng, [first])
    assert not second.done()
    drain(eng, [second])
    assert [len(s.tokens) for f in (first, second) for s in f.result().sample.sequences] == [27] * 4
