"""The trainer's scratch space for paged-out adapters: a local directory, one file per key.

``AdapterBank`` writes an adapter's bytes here when more runs exist than fit in memory and reads them back
when the run is scheduled again. A page is worth something only to the process that wrote it (the bank's
index of paged-out runs lives in memory), so this is scratch, not storage: no object store, no S3, nothing
another process reads. Whatever must outlive the trainer (checkpoints, recovery snapshots) goes through
the checkpoints service (``lathe.checkpoints.client``). Keys are ``/``-separated relative paths that the bank
builds from hashes and file names.
"""

from __future__ import annotations

from pathlib import Path


class DirPages:
    """``bank.PageStore`` in the directory ``root`` (created if missing)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"page key {key!r} must be a relative '/'-separated path without '.' or '..' parts")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def keys(self, prefix: str) -> list[str]:
        found = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in found if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
