"""Shared fixtures: a model cache under the repo (or $LATHE_CACHE), the generated tiny models, torch's thread
count at 1 and 2, and the embedded stack of real service processes, one shared by the modules that need the plain
one (starting one costs seconds, and about twenty modules need it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROCESS_FIXTURES = frozenset({"shared_stack", "stack", "quota_stack", "s3_stack", "pool_stack", "live", "secured",
                              "server", "s3", "client", "postgres"})
"""Fixtures that start service processes (a stack, a checkpoints or S3 server, PostgreSQL)."""
PROCESS_MODULES = frozenset({"test_supervision", "test_trainer_ranks", "test_isa_paths", "test_sampler",
                             "test_hostile_losses", "test_service_trust", "test_checkpoint_large"})
"""Modules whose tests start such processes themselves (a service, a child pytest, a rank) without a fixture."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``processes`` every test that starts service processes, so ``make test-fast`` can leave them out."""
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__.split(".")[-1] in \
                PROCESS_MODULES:
            item.add_marker(pytest.mark.processes)


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


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Lathe's C library (``lathe.kernels.chain``) as on a machine without a C compiler: it does not build."""
    from lathe.kernels import chain

    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("LATHE_KERNEL_CACHE", str(tmp_path))
    chain._library.cache_clear()
    yield
    chain._library.cache_clear()


@pytest.fixture(scope="session")
def model_cache() -> Path:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_dir(model_cache: Path) -> Path:
    from lathe.models.tiny import ensure_tiny_model

    return ensure_tiny_model(model_cache, "llama")


@contextlib.contextmanager
def tiny_stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, models: str = "lathe/tiny-llama",
               metrics: bool = False) -> Iterator:
    """Every service as its own process on loopback, serving the tiny model (or ``models``), one thread per pool;
    ``metrics``: each serves Prometheus metrics too."""
    from lathe.stack import Stack, StackConfig

    cfg = StackConfig(models=models, store_root=tmp_path_factory.mktemp("store"),
                      cache_root=model_cache, trainer_threads=1, sampler_threads=1, metrics=metrics)
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator:
    """One ``tiny_stack`` for the whole session, serving the tiny Llama (by its name, and by its directory, as the
    cookbook's recipes name a model whose tokenizer they load) and the tiny Qwen3-MoE, with Prometheus metrics. The
    modules that share it keep out of each other's way by their tenants (each uses API keys of its own, and in open
    mode a key is its own tenant), and read counters as differences."""
    with tiny_stack(tmp_path_factory, model_cache, f"lathe/tiny-llama,lathe/tiny-qwen3-moe,{tiny_dir}",
                    metrics=True) as s:
        yield s


@pytest.fixture(scope="module")
def stack(shared_stack: object) -> object:
    """The shared stack; a module that needs one of its own (it reads a service's peak memory, say) overrides this
    fixture with ``tiny_stack``."""
    return shared_stack
