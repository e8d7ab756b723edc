"""Shared fixtures: a model cache under the repo (or $LATHE_CACHE), the generated tiny models, torch's thread
count at 1 and 2, and the embedded stack of real service processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    return Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The test runs once at 1 and once at 2 torch threads (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_cache() -> Path:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_dir(model_cache: Path) -> Path:
    from lathe.models.tiny import ensure_tiny_model

    return ensure_tiny_model(model_cache, "llama")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator:
    """Every service as its own process on loopback, serving the tiny model (one stack per test module)."""
    from lathe.stack import Stack, StackConfig

    cfg = StackConfig(models="lathe/tiny-llama", store_root=tmp_path_factory.mktemp("store"),
                      cache_root=model_cache, trainer_threads=1, sampler_threads=1)
    with Stack(cfg) as s:
        yield s
