"""The checkpoints core: put / get / stat / list / delete / sweep over an ``ObjectStore``. No gRPC here.

The store's key layout and the manifest format are ``layout.py``'s, the sweep's rule ``sweep.py``'s. A save
streams every file, hashing it on the way, under a fresh generation, then writes the manifest that names
it. The manifest write is atomic, so readers, which always start from the manifest, see the previous
checkpoint or the new one, never a half-written one; a crash or store outage before it leaves only
unreferenced files, which ``sweep_expired`` removes once they are older than ``staging_grace_s``. An
overwrite swaps the manifest, then deletes the old generation. Readers check every file's size and
sha256 against the manifest as it streams past.

Ownership: a checkpoint belongs to the tenant that saved it, and a run id to the tenant whose
checkpoints it holds. Another tenant's checkpoint answers ``NotFound`` with the very message a missing
one gets, and listing another tenant's run answers as a run with no checkpoints, so no answer tells
whether someone else's checkpoint exists. (Saving into another tenant's run is ``PermissionDenied``: only
the trainer saves, into the run it serves for that tenant.) The run's owner record makes that check one small
read (none once this process has seen the run). A TTL is at most ``MAX_TTL_S``.

Downloads: ``locate`` names every file's size and sha256 and, on a ``PresigningStore`` (S3), a presigned GET
URL, so clients read big checkpoints straight from the store; ``export`` copies a checkpoint's PEFT adapter
files into an ``external_weights`` checkpoint (age-encrypted on request) for Tinker's download path.

Quota: a save may carry the tenant's byte quota (``max_tenant_bytes``, set by the gateway's quotas); the bytes
of the tenant's listed checkpoints that are still live count against it, so a delete or an expiry frees room.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from lathe.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from lathe.types import MAX_TTL_S

from .encryption import age_encrypter
from .layout import (
    CheckpointInfo,
    CheckpointList,
    FileEntry,
    Manifest,
    Replaced,
    Tally,
    blob_prefix,
    delete_files,
    manifest_key,
    new_generation,
    owner_key,
    read_manifest,
    scan_manifests,
    stream_file,
    stream_files,
    tenant_segment,
)
from .paths import LISTED_KINDS, CheckpointPath, check_part
from .store import ObjectStore, PresigningStore
from .sweep import Sweep, sweep

READ_ATTEMPTS = 3  # whole-checkpoint reads that a concurrent overwrite may restart
QUOTA_LOCKS = 64  # stripes of the per-tenant lock around a quota check and its commit
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what an external_weights export holds
MAX_URL_S = 7 * 24 * 3600  # S3's longest presigned URL


@dataclass(frozen=True, slots=True)
class StoredFile:
    """One file of a checkpoint as ``locate`` names it; ``url`` is "" where the store signs no URLs."""

    size: int
    sha256: str
    url: str


def _check_tenant(tenant: str) -> None:
    if not tenant:
        raise InvalidArgument("tenant is empty")


def _check_ttl(ttl_seconds: int) -> None:
    if not 0 <= ttl_seconds <= MAX_TTL_S:
        raise InvalidArgument(f"ttl_seconds = {ttl_seconds} must be in [0, {MAX_TTL_S}] (0: keep forever)")


class CheckpointService:
    """Checkpoints of many tenants in one ``ObjectStore``; thread-safe (manifest swaps take one lock).

    ``clock`` gives unix seconds (injectable for TTL tests). ``staging_grace_s`` bounds a save: one
    that takes longer fails instead of committing, and unreferenced files older than it are orphans.
    """

    def __init__(self, store: ObjectStore, clock: Callable[[], float] = time.time, *,
                 staging_grace_s: float = 3600.0) -> None:
        if staging_grace_s <= 0:
            raise ValueError(f"staging_grace_s must be > 0, got {staging_grace_s}")
        self.store = store
        self.clock = clock
        self.staging_grace_s = staging_grace_s
        self._commit = threading.Lock()
        self._quota_locks = tuple(threading.Lock() for _ in range(QUOTA_LOCKS))
        self._owners: dict[str, str] = {}  # run id -> owner tenant segment, as read or written (never changes)

    # ---- the calls ----

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: Mapping[str, bytes],
            metadata_json: str = "", ttl_seconds: int = 0, overwrite: bool = False, max_tenant_bytes: int = 0
            ) -> CheckpointInfo:
        """Save ``files`` as ``tinker://<run_id>/<kind>/<name>``, visible only once all are stored."""
        path = CheckpointPath(run_id, kind, name)
        if not files:
            raise InvalidArgument(f"files is empty: checkpoint {path} needs at least one file")
        for file_name in files:
            check_part("file name", file_name)
        return self.put_stream(tenant=tenant, run_id=run_id, kind=kind, name=name,
                               files=((n, (data,)) for n, data in sorted(files.items())),
                               metadata_json=metadata_json, ttl_seconds=ttl_seconds, overwrite=overwrite,
                               max_tenant_bytes=max_tenant_bytes)

    def put_stream(self, *, tenant: str, run_id: str, kind: str, name: str,
                   files: Iterable[tuple[str, Iterable[bytes]]], metadata_json: str = "", ttl_seconds: int = 0,
                   overwrite: bool = False, max_tenant_bytes: int = 0) -> CheckpointInfo:
        """``put`` for files that arrive as (file name, chunks) pairs, each consumed once, in order: every
        file streams into the store while it is hashed, so no file needs to be in memory whole. If the
        stream fails (or the store does), nothing becomes visible and the files stored so far are removed
        (or, if the store is down, left for the sweep). With ``max_tenant_bytes`` (the tenant's quota; 0: none)
        a save that would leave the tenant's listed, live checkpoints holding more bytes than that (the one it
        replaces not counted) fails with ``ResourceExhausted`` and its files are removed."""
        _check_tenant(tenant)
        path = CheckpointPath(run_id, kind, name)
        if metadata_json:
            try:
                is_object = isinstance(json.loads(metadata_json), dict)
            except ValueError as e:
                raise InvalidArgument(f"metadata_json of {path} is not valid JSON: {e}") from None
            if not is_object:
                raise InvalidArgument(f"metadata_json of {path} must be a JSON object, got {metadata_json[:64]!r}")
        _check_ttl(ttl_seconds)
        if max_tenant_bytes < 0:
            raise InvalidArgument(f"max_tenant_bytes = {max_tenant_bytes} must be >= 0 (0: no quota)")

        started = self.clock()
        self._check_writable(tenant, path, overwrite)  # fail fast, before uploading anything
        generation = new_generation(started)
        prefix = blob_prefix(tenant, path, generation)
        entries: dict[str, FileEntry] = {}
        try:
            for file_name, chunks in files:
                check_part("file name", file_name)
                if file_name in entries:
                    raise InvalidArgument(f"file name {file_name!r} appears twice in checkpoint {path}")
                tally = Tally()
                entries[file_name] = FileEntry(-1, "")  # claimed: removed on failure even if half-written
                self.store.put_stream(prefix + file_name, tally.feed(chunks))
                entries[file_name] = tally.file()
        except BaseException:
            self._discard(prefix, entries)
            raise
        if not entries:
            raise InvalidArgument(f"files is empty: checkpoint {path} needs at least one file")
        # one tenant's quota check and commit at a time, so two saves cannot both fit in the same room
        with self._quota_locks[hash(tenant) % QUOTA_LOCKS]:
            if max_tenant_bytes:
                try:
                    self._check_quota(tenant, path, sum(f.size for f in entries.values()), max_tenant_bytes)
                except ResourceExhausted:
                    self._discard(prefix, entries)
                    raise
            # not under the cleanup above: a manifest write that fails may still have landed
            return self._commit_manifest(tenant, path, generation, entries, started, metadata_json, ttl_seconds,
                                         overwrite)

    def _discard(self, prefix: str, entries: Iterable[str]) -> None:
        """Remove the files of a save that will not commit."""
        for file_name in entries:
            with contextlib.suppress(Exception):  # best effort: the sweep collects what is left
                self.store.delete(prefix + file_name)

    def _check_quota(self, tenant: str, path: CheckpointPath, size: int, limit: int) -> None:
        """Refuse a save of ``size`` bytes to ``path`` that would take ``tenant`` over ``limit`` bytes of listed,
        live checkpoints. Reads every manifest of the tenant: a save with a quota costs that many small reads."""
        now = self.clock()
        used = sum(m.info.size_bytes for m in scan_manifests(self.store, tenant, "")
                   if m.info.kind in LISTED_KINDS and m.live(now) and m.path != path)
        if used + size > limit:
            raise ResourceExhausted(f"quota max_checkpoint_bytes: tenant has {used} bytes in live checkpoints and "
                                    f"saving {path} would add {size}, the limit is {limit}; delete checkpoints to "
                                    "make room")

    def _commit_manifest(self, tenant: str, path: CheckpointPath, generation: str, entries: dict[str, FileEntry],
                         started: float, metadata_json: str, ttl_seconds: int, overwrite: bool) -> CheckpointInfo:
        """Write the manifest naming ``generation`` (the commit point), then collect the one it replaced."""
        run_id, kind, name = path.run_id, path.kind, path.name
        with self._commit:
            old = self._check_writable(tenant, path, overwrite)
            if self._run_owner(run_id) is None:  # the run's first save claims it
                self.store.put(owner_key(run_id), tenant_segment(tenant).encode())
                self._owners[run_id] = tenant_segment(tenant)
            now = self.clock()
            if now - started > self.staging_grace_s:
                raise Unavailable(f"saving {path} took {now - started:.0f} s, longer than the "
                                  f"{self.staging_grace_s:.0f} s staging grace; retry the save")
            info = CheckpointInfo(path=str(path), tenant=tenant, run_id=run_id, kind=kind, name=name,
                                  size_bytes=sum(f.size for f in entries.values()), created_at=now,
                                  expires_at=now + ttl_seconds if ttl_seconds else 0.0,
                                  metadata_json=metadata_json)
            self.store.put(manifest_key(tenant, path), Manifest(info, generation, entries).to_json())
        if old is not None:
            delete_files(self.store, old)
        return info

    def get(self, tenant: str, path: str) -> tuple[CheckpointInfo, dict[str, bytes]]:
        """The checkpoint's info and files, each verified against the manifest's size and sha256 (read
        again, up to ``READ_ATTEMPTS`` times, if a concurrent overwrite replaces it meanwhile)."""
        for attempt in range(READ_ATTEMPTS):
            info, sizes, chunks = self.get_stream(tenant, path)
            buffers = {n: bytearray() for n in sizes}
            try:
                for file_name, chunk in chunks:
                    buffers[file_name] += chunk
            except Replaced:
                if attempt == READ_ATTEMPTS - 1:
                    raise
                continue
            return info, {n: bytes(b) for n, b in buffers.items()}
        raise AssertionError("unreachable")

    def get_stream(self, tenant: str, path: str
                   ) -> tuple[CheckpointInfo, dict[str, int], Iterator[tuple[str, bytes]]]:
        """The checkpoint's info, its file sizes, and its files as (file name, chunk) pairs, file by file.

        Each file is verified as its last chunk passes: a corrupt or missing object raises ``Internal``
        naming its key, so a consumer must not use a file before the iterator has moved past it.
        """
        m = self._visible(tenant, self._parse(tenant, path))
        return m.info, {n: f.size for n, f in sorted(m.files.items())}, stream_files(self.store, m)

    def stat(self, tenant: str, path: str) -> CheckpointInfo:
        return self._visible(tenant, self._parse(tenant, path)).info

    def delete(self, tenant: str, path: str) -> None:
        p = self._parse(tenant, path)
        with self._commit:
            m = self._visible(tenant, p)
            self.store.delete(manifest_key(tenant, p))
        delete_files(self.store, m)

    def set_ttl(self, tenant: str, path: str, ttl_seconds: int) -> CheckpointInfo:
        """Make the checkpoint expire ``ttl_seconds`` from now (0: never)."""
        _check_ttl(ttl_seconds)
        return self._update(tenant, path, expires_at=self.clock() + ttl_seconds if ttl_seconds else 0.0)

    def set_public(self, tenant: str, path: str, public: bool) -> CheckpointInfo:
        """Publish or unpublish the checkpoint (again is a no-op: Tinker's SDK retries a 409 for minutes)."""
        return self._update(tenant, path, public=public)

    def _update(self, tenant: str, path: str, **changes: object) -> CheckpointInfo:
        """Rewrite the manifest of the caller's live checkpoint at ``path`` with ``changes`` to its info (its
        files stay)."""
        p = self._parse(tenant, path)
        with self._commit:
            m = self._visible(tenant, p)
            info = replace(m.info, **changes)
            self.store.put(manifest_key(tenant, p), Manifest(info, m.generation, m.files).to_json())
        return info

    def locate(self, tenant: str, path: str, expires_in_s: int) -> tuple[CheckpointInfo, dict[str, StoredFile], float]:
        """The checkpoint's info, each file's size, sha256 and (on a ``PresigningStore`` that presigns) a GET URL
        valid for ``expires_in_s`` seconds, and when those URLs expire (0.0: there are none). The store checks
        nothing on such a read: the reader compares each file with its size and sha256."""
        if not 1 <= expires_in_s <= MAX_URL_S:
            raise InvalidArgument(f"expires_in_s = {expires_in_s} must be in [1, {MAX_URL_S}]")
        m = self._visible(tenant, self._parse(tenant, path))
        signer = self.store if isinstance(self.store, PresigningStore) else None
        urls = {n: signer.presign_get(m.blob_prefix() + n, expires_in_s) for n in m.files} if signer else {}
        if None in urls.values():  # a store that hands out no URLs
            urls = {}
        files = {n: StoredFile(f.size, f.sha256, urls.get(n) or "") for n, f in sorted(m.files.items())}
        return m.info, files, self.clock() + expires_in_s if urls else 0.0

    def export(self, *, tenant: str, source_path: str, name: str, ttl_seconds: int = 0,
               age_recipients: Sequence[str] = (), max_tenant_bytes: int = 0) -> CheckpointInfo:
        """Copy the PEFT files (``PEFT_FILES``) of the caller's weights or sampler_weights checkpoint at
        ``source_path`` into ``tinker://<its run>/external_weights/<name>`` (replacing one there), streamed and
        verified on the way. With ``age_recipients`` each file is age-encrypted to them and named ``<file>.age``
        (encryption holds one adapter file in memory). ``max_tenant_bytes`` binds as on a save (``put_stream``):
        a refused export removes what it wrote."""
        src = self._visible(tenant, self._parse(tenant, source_path))
        if src.info.kind not in ("weights", "sampler_weights"):
            raise InvalidArgument(f"source_path {source_path!r} is a {src.info.kind} checkpoint; export a weights or "
                                  "sampler_weights one")
        missing = [n for n in PEFT_FILES if n not in src.files]
        if missing:
            raise InvalidArgument(f"checkpoint {source_path} has no {', '.join(missing)} to export")
        encrypt = age_encrypter(age_recipients) if age_recipients else None

        def files() -> Iterator[tuple[str, Iterable[bytes]]]:
            for n in PEFT_FILES:
                chunks = stream_file(self.store, src, n, src.files[n])
                yield (n, chunks) if encrypt is None else (f"{n}.age", (encrypt(b"".join(chunks)),))

        meta = {**json.loads(src.info.metadata_json or "{}"), "exported_from": src.info.path}
        return self.put_stream(tenant=tenant, run_id=src.info.run_id, kind="external_weights", name=name,
                               files=files(), metadata_json=json.dumps(meta), ttl_seconds=ttl_seconds, overwrite=True,
                               max_tenant_bytes=max_tenant_bytes)

    def list(self, tenant: str, run_id: str = "", limit: int = 0, offset: int = 0) -> CheckpointList:
        """The tenant's live checkpoints (of one run, or all), oldest first; ``limit`` 0 = no limit."""
        _check_tenant(tenant)
        if run_id:
            check_part("run_id", run_id, run_id=True)
        if limit < 0 or offset < 0:
            raise InvalidArgument(f"limit and offset must be >= 0, got limit={limit} offset={offset}")
        manifests = list(scan_manifests(self.store, tenant, run_id))
        now = self.clock()
        mine = sorted((m.info for m in manifests
                       if m.info.tenant == tenant and m.info.kind in LISTED_KINDS and m.live(now)),
                      key=lambda i: (i.created_at, i.path))
        return CheckpointList(mine[offset:offset + limit] if limit else mine[offset:], len(mine))

    def sweep_expired(self) -> Sweep:
        """Delete expired checkpoints, then files that no manifest names and older than the grace (``sweep.py``)."""
        return sweep(self.store, self._commit, self.clock(), self.staging_grace_s)

    # ---- helpers ----

    def _parse(self, tenant: str, path: str) -> CheckpointPath:
        _check_tenant(tenant)
        return CheckpointPath.parse(path)

    def _visible(self, tenant: str, p: CheckpointPath) -> Manifest:
        """The live manifest at ``p`` if ``tenant`` owns it; ``NotFound`` otherwise, the same for a missing
        checkpoint and for another tenant's (only its owner learns that it expired)."""
        m = read_manifest(self.store, tenant, p)
        if m is None:
            raise NotFound(f"checkpoint {p} not found")
        if not m.live(self.clock()):
            raise NotFound(f"checkpoint {p} expired at unix time {m.info.expires_at:.0f}")
        return m

    def _check_writable(self, tenant: str, p: CheckpointPath, overwrite: bool) -> Manifest | None:
        """The manifest a save to ``p`` would replace (None if none), after the ownership and overwrite rules."""
        owner = self._run_owner(p.run_id)  # a run holds the checkpoints of one tenant only
        if owner is not None and owner != tenant_segment(tenant):
            raise PermissionDenied(f"run {p.run_id!r} belongs to another tenant; cannot save {p}")
        old = read_manifest(self.store, tenant, p)
        if old is not None and old.live(self.clock()) and not overwrite:
            raise AlreadyExists(f"checkpoint {p} already exists; save with overwrite=true to replace it")
        return old

    def _run_owner(self, run_id: str) -> str | None:
        """The tenant segment that owns ``run_id`` (None: no save has claimed it yet)."""
        if run_id not in self._owners:
            try:
                self._owners[run_id] = self.store.get(owner_key(run_id)).decode()
            except KeyError:
                return None
        return self._owners[run_id]
