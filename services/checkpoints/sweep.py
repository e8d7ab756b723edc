"""The sweep: what expiry and crashed saves leave in the store, removed.

Owns the rule of what is garbage: a manifest past its TTL (deleted with its files), and a file that no live
manifest names and whose save started longer ago than the staging grace (a save commits within the grace of its
start, so such a file never will be named). ``CheckpointService.sweep_expired`` runs it under the service's commit
lock; the server calls that periodically.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .layout import delete_files, generation_time, manifest_key, read_manifest, scan_manifests
from .store import ObjectStore


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one ``sweep_expired`` removed."""

    expired: int  # checkpoints past their TTL
    orphan_files: int  # files of saves that never committed (crashed) or were replaced


def sweep(store: ObjectStore, commit: threading.Lock, now: float, staging_grace_s: float) -> Sweep:
    """Delete the checkpoints expired at ``now``, then files that no manifest names and older than the grace.
    ``commit`` is the lock every manifest swap takes: a checkpoint replaced since it was listed is kept."""
    expired = 0
    referenced: set[str] = set()  # blob prefixes of the generations that live manifests name
    for m in scan_manifests(store, "", ""):
        if m.live(now):
            referenced.add(m.blob_prefix())
            continue
        with commit:
            latest = read_manifest(store, m.info.tenant, m.path)
            if latest is not None and latest.generation != m.generation:  # replaced since listed
                referenced.add(latest.blob_prefix())
                continue
            store.delete(manifest_key(m.info.tenant, m.path))
        delete_files(store, m)
        expired += 1
    orphans = 0
    for key in store.keys("blobs/"):
        prefix, _, _ = key.rpartition("/")
        born = generation_time(prefix.rpartition("/")[2])
        # a save commits within the grace of its start, so one older than it at `now` never will
        if prefix + "/" not in referenced and born is not None and born + staging_grace_s < now:
            store.delete(key)
            orphans += 1
    return Sweep(expired, orphans)
