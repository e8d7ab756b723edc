"""Shared fixtures: a model cache under the repo (or $LATHE_CACHE) and the generated tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    return Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))


@pytest.fixture(scope="session")
def model_cache() -> Path:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_dir(model_cache: Path) -> Path:
    from lathe.models.tiny import ensure_tiny_model

    return ensure_tiny_model(model_cache, "llama")
