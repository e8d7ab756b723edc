"""The checkpoints core: put / get / stat / list / delete / sweep over an ``ObjectStore``. No gRPC here.

Layout in the store (one checkpoint = one manifest + one generation of files)::

    manifests/<run_id>/<kind>/<name>.json            the commit point: owner, times, metadata, files
    blobs/<run_id>/<kind>/<name>/<generation>/<file>  the files of one save, never rewritten

A save writes every file under a fresh ``generation`` (``<unix ms>-<random hex>``), then writes the
manifest that names it. The manifest write is atomic, so readers, which always start from the
manifest, see the previous checkpoint or the new one, never a half-written one; a crash before it
leaves only unreferenced files, which ``sweep_expired`` removes once they are older than
``staging_grace_s``. An overwrite swaps the manifest, then deletes the old generation. Readers check
every file's size and sha256 against the manifest.

Ownership: a checkpoint belongs to the tenant that saved it, and a run id to the tenant whose
checkpoints it holds. Another tenant's checkpoint or run is ``PermissionDenied``; a missing,
deleted or expired one is ``NotFound``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass

from lathe.errors import AlreadyExists, Internal, InvalidArgument, NotFound, PermissionDenied, Unavailable

from .paths import CheckpointPath, check_part
from .store import ObjectStore

MANIFEST_FORMAT = 1


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What a caller learns about a checkpoint (the fields of ``lathe.v1.CheckpointInfo``)."""

    path: str
    tenant: str
    run_id: str
    kind: str
    name: str
    size_bytes: int
    created_at: float
    expires_at: float  # 0.0 = never
    metadata_json: str


@dataclass(frozen=True, slots=True)
class CheckpointList:
    checkpoints: list[CheckpointInfo]  # one page, oldest first
    total_count: int  # before limit / offset


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one ``sweep_expired`` removed."""

    expired: int  # checkpoints past their TTL
    orphan_files: int  # files of saves that never committed (crashed) or were replaced


@dataclass(frozen=True, slots=True)
class _File:
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class _Manifest:
    info: CheckpointInfo
    generation: str
    files: dict[str, _File]

    @property
    def path(self) -> CheckpointPath:
        return CheckpointPath(self.info.run_id, self.info.kind, self.info.name)

    def blob_prefix(self) -> str:
        return _blob_prefix(self.path, self.generation)

    def to_json(self) -> bytes:
        doc = {"format": MANIFEST_FORMAT, "generation": self.generation, **asdict(self.info),
               "files": {n: asdict(f) for n, f in self.files.items()}}
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> _Manifest:
        try:
            doc = json.loads(raw)
            if doc.pop("format") != MANIFEST_FORMAT:
                raise ValueError("unknown manifest format")
            files = {n: _File(**f) for n, f in doc.pop("files").items()}
            generation = doc.pop("generation")
            return cls(CheckpointInfo(**doc), generation, files)
        except (ValueError, KeyError, TypeError) as e:
            raise Internal(f"checkpoint manifest {key!r} is unreadable: {e}") from None


def _manifest_key(p: CheckpointPath) -> str:
    return f"manifests/{p.run_id}/{p.kind}/{p.name}.json"


def _blob_prefix(p: CheckpointPath, generation: str) -> str:
    return f"blobs/{p.run_id}/{p.kind}/{p.name}/{generation}/"


def _generation_time(generation: str) -> float | None:
    """When the save that made ``generation`` started (unix seconds); None if it is not one of ours."""
    ms, _, _ = generation.partition("-")
    return int(ms) / 1000 if ms.isdigit() else None


def _check_tenant(tenant: str) -> None:
    if not tenant:
        raise InvalidArgument("tenant is empty")


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

    # ---- the five calls ----

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: Mapping[str, bytes],
            metadata_json: str = "", ttl_seconds: int = 0, overwrite: bool = False) -> CheckpointInfo:
        """Save ``files`` as ``tinker://<run_id>/<kind>/<name>``, visible only once all are stored."""
        _check_tenant(tenant)
        path = CheckpointPath(run_id, kind, name)
        if not files:
            raise InvalidArgument(f"files is empty: checkpoint {path} needs at least one file")
        for file_name in files:
            check_part("file name", file_name)
        if metadata_json:
            try:
                is_object = isinstance(json.loads(metadata_json), dict)
            except ValueError as e:
                raise InvalidArgument(f"metadata_json of {path} is not valid JSON: {e}") from None
            if not is_object:
                raise InvalidArgument(f"metadata_json of {path} must be a JSON object, got {metadata_json[:64]!r}")
        if ttl_seconds < 0:
            raise InvalidArgument(f"ttl_seconds must be >= 0 (0 = keep forever), got {ttl_seconds}")

        started = self.clock()
        self._check_writable(tenant, path, overwrite)  # fail fast, before uploading anything
        generation = f"{int(started * 1000):013d}-{secrets.token_hex(4)}"
        prefix = _blob_prefix(path, generation)
        entries = {}
        for file_name, data in sorted(files.items()):
            self.store.put(prefix + file_name, data)
            entries[file_name] = _File(len(data), hashlib.sha256(data).hexdigest())

        with self._commit:
            old = self._check_writable(tenant, path, overwrite)
            now = self.clock()
            if now - started > self.staging_grace_s:
                raise Unavailable(f"saving {path} took {now - started:.0f} s, longer than the "
                                  f"{self.staging_grace_s:.0f} s staging grace; retry the save")
            info = CheckpointInfo(path=str(path), tenant=tenant, run_id=run_id, kind=kind, name=name,
                                  size_bytes=sum(f.size for f in entries.values()), created_at=now,
                                  expires_at=now + ttl_seconds if ttl_seconds else 0.0,
                                  metadata_json=metadata_json)
            self.store.put(_manifest_key(path), _Manifest(info, generation, entries).to_json())
        if old is not None:
            self._delete_files(old)
        return info

    def get(self, tenant: str, path: str) -> tuple[CheckpointInfo, dict[str, bytes]]:
        """The checkpoint's info and files, each verified against the manifest's size and sha256."""
        p = self._parse(tenant, path)
        m = self._visible(tenant, p)
        while True:
            try:
                return m.info, {n: self._read_file(m, n) for n in sorted(m.files)}
            except KeyError as e:
                latest = self._visible(tenant, p)
                if latest.generation == m.generation:
                    raise Internal(f"checkpoint {p}: stored file {e.args[0]!r} is missing") from None
                m = latest  # replaced by a concurrent overwrite while we read: read the new one

    def stat(self, tenant: str, path: str) -> CheckpointInfo:
        return self._visible(tenant, self._parse(tenant, path)).info

    def delete(self, tenant: str, path: str) -> None:
        p = self._parse(tenant, path)
        with self._commit:
            m = self._visible(tenant, p)
            self.store.delete(_manifest_key(p))
        self._delete_files(m)

    def list(self, tenant: str, run_id: str = "", limit: int = 0, offset: int = 0) -> CheckpointList:
        """The tenant's live checkpoints (of one run, or all), oldest first; ``limit`` 0 = no limit."""
        _check_tenant(tenant)
        if run_id:
            check_part("run_id", run_id, run_id=True)
        if limit < 0 or offset < 0:
            raise InvalidArgument(f"limit and offset must be >= 0, got limit={limit} offset={offset}")
        manifests = list(self._manifests(run_id))
        if run_id and any(m.info.tenant != tenant for m in manifests):
            raise PermissionDenied(f"run {run_id!r} belongs to another tenant")
        now = self.clock()
        mine = sorted((m.info for m in manifests if m.info.tenant == tenant and self._live(m, now)),
                      key=lambda i: (i.created_at, i.path))
        return CheckpointList(mine[offset:offset + limit] if limit else mine[offset:], len(mine))

    def sweep_expired(self) -> Sweep:
        """Delete expired checkpoints, then files that no manifest names and older than the grace."""
        now = self.clock()
        expired = 0
        referenced: set[str] = set()  # blob prefixes of the generations that live manifests name
        for m in self._manifests(""):
            if self._live(m, now):
                referenced.add(m.blob_prefix())
                continue
            with self._commit:
                latest = self._read_manifest(m.path)
                if latest is not None and latest.generation != m.generation:  # replaced since listed
                    referenced.add(latest.blob_prefix())
                    continue
                self.store.delete(_manifest_key(m.path))
            self._delete_files(m)
            expired += 1
        orphans = 0
        for key in self.store.keys("blobs/"):
            prefix, _, _ = key.rpartition("/")
            born = _generation_time(prefix.rpartition("/")[2])
            # a save commits within the grace of its start, so one older than it at `now` never will
            if prefix + "/" not in referenced and born is not None and born + self.staging_grace_s < now:
                self.store.delete(key)
                orphans += 1
        return Sweep(expired, orphans)

    # ---- helpers ----

    def _parse(self, tenant: str, path: str) -> CheckpointPath:
        _check_tenant(tenant)
        return CheckpointPath.parse(path)

    def _live(self, m: _Manifest, now: float) -> bool:
        return not m.info.expires_at or now < m.info.expires_at

    def _read_manifest(self, p: CheckpointPath) -> _Manifest | None:
        key = _manifest_key(p)
        try:
            return _Manifest.from_json(key, self.store.get(key))
        except KeyError:
            return None

    def _manifests(self, run_id: str) -> Iterator[_Manifest]:
        """Every manifest (live or expired) of one run, or of all runs when ``run_id`` is empty."""
        for key in self.store.keys(f"manifests/{run_id}/" if run_id else "manifests/"):
            try:
                yield _Manifest.from_json(key, self.store.get(key))
            except KeyError:  # deleted since it was listed
                continue

    def _visible(self, tenant: str, p: CheckpointPath) -> _Manifest:
        """The live manifest at ``p`` if ``tenant`` owns it; NotFound / PermissionDenied otherwise."""
        m = self._read_manifest(p)
        if m is None:
            raise NotFound(f"checkpoint {p} not found")
        owned = m.info.tenant == tenant
        if not self._live(m, self.clock()):
            raise NotFound(f"checkpoint {p} expired at unix time {m.info.expires_at:.0f}" if owned
                           else f"checkpoint {p} not found")
        if not owned:
            raise PermissionDenied(f"checkpoint {p} belongs to another tenant")
        return m

    def _check_writable(self, tenant: str, p: CheckpointPath, overwrite: bool) -> _Manifest | None:
        """The manifest a save to ``p`` would replace (None if none), after the ownership and overwrite rules."""
        owner = next((m.info.tenant for m in self._manifests(p.run_id)), None)
        if owner is not None and owner != tenant:
            raise PermissionDenied(f"run {p.run_id!r} belongs to another tenant; cannot save {p}")
        old = self._read_manifest(p)
        if old is not None and self._live(old, self.clock()) and not overwrite:
            raise AlreadyExists(f"checkpoint {p} already exists; save with overwrite=true to replace it")
        return old

    def _read_file(self, m: _Manifest, name: str) -> bytes:
        data = self.store.get(m.blob_prefix() + name)
        want = m.files[name]
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != want.size or digest != want.sha256:
            raise Internal(f"checkpoint {m.info.path}: file {name!r} is corrupt ({len(data)} bytes, sha256 "
                           f"{digest[:12]}..., the manifest says {want.size} bytes, {want.sha256[:12]}...)")
        return data

    def _delete_files(self, m: _Manifest) -> None:
        prefix = m.blob_prefix()
        for name in m.files:
            self.store.delete(prefix + name)
