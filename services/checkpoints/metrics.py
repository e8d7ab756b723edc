"""The checkpoints service's Prometheus metrics: bytes saved and loaded, and how long saves and loads take.

Owned by the ``CheckpointsServicer`` (the gRPC door records each whole call, streaming included); the registry is
the process's ``Probes`` registry, served by ``--metrics-port`` beside the gRPC request metrics. Every series is
labelled with the kind of object store behind the service (``store``: ``file``, ``s3``; one value per process).
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def store_kind(root: Path | str) -> str:
    """The store kind of a ``--root`` (``lathe.checkpoints.store.open_store``): its URL scheme, or ``file``."""
    scheme, sep, _ = str(root).partition("://")
    return scheme if sep else "file"


class CheckpointMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, store: str = "file") -> None:
        r = registry if registry is not None else CollectorRegistry()
        saved = Counter("lathe_checkpoints_saved_bytes", "Bytes of checkpoints saved", ["store"], registry=r)
        loaded = Counter("lathe_checkpoints_loaded_bytes", "Bytes of checkpoints read", ["store"], registry=r)
        save_s = Histogram("lathe_checkpoints_save_seconds", "Time to save one checkpoint (the whole call)",
                           ["store"], buckets=_TIME_BUCKETS, registry=r)
        load_s = Histogram("lathe_checkpoints_load_seconds", "Time to read one checkpoint (the whole call)",
                           ["store"], buckets=_TIME_BUCKETS, registry=r)
        self.registry = r
        self._saved, self._loaded = saved.labels(store=store), loaded.labels(store=store)
        self._save_s, self._load_s = save_s.labels(store=store), load_s.labels(store=store)

    def saved(self, size_bytes: int, seconds: float) -> None:
        self._saved.inc(size_bytes)
        self._save_s.observe(seconds)

    def loaded(self, size_bytes: int, seconds: float) -> None:
        self._loaded.inc(size_bytes)
        self._load_s.observe(seconds)
