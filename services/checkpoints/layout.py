"""Where a checkpoint lives in the ``ObjectStore`` and what its manifest records; reading both back.

Layout in the store (one checkpoint = one manifest + one generation of files), per tenant and run::

    manifests/<tenant>/<run_id>/<kind>/<name>.json            the commit point: owner, times, metadata, files
    blobs/<tenant>/<run_id>/<kind>/<name>/<generation>/<file>  the files of one save, never rewritten
    runs/<run_id>.owner                                        the run's tenant segment, written by its first save

where ``<tenant>`` is ``t-`` and 32 hex digits of the tenant name's sha256 (any tenant name is a safe
key segment, and a tenant's objects share one prefix) and ``<generation>`` is ``<unix ms>-<random hex>``,
fresh for every save.

Owns: the key of every object, the manifest's JSON format (``Manifest``, ``CheckpointInfo``, ``FileEntry``),
and the reads of both: manifests by key or prefix, and a file's chunks checked against its manifest entry
(``stream_file``). The rules (ownership, TTL, quota, when to commit) are ``service.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from lathe.errors import Internal, Unavailable

from .paths import CheckpointPath
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
    public: bool = False  # published by its owner (a flag Tinker's listing shows; it grants no one access)


@dataclass(frozen=True, slots=True)
class CheckpointList:
    checkpoints: list[CheckpointInfo]  # one page, oldest first
    total_count: int  # before limit / offset


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file as a manifest records it."""

    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    info: CheckpointInfo
    generation: str
    files: dict[str, FileEntry]

    @property
    def path(self) -> CheckpointPath:
        return CheckpointPath(self.info.run_id, self.info.kind, self.info.name)

    def blob_prefix(self) -> str:
        return blob_prefix(self.info.tenant, self.path, self.generation)

    def live(self, now: float) -> bool:
        return not self.info.expires_at or now < self.info.expires_at

    def to_json(self) -> bytes:
        doc = {"format": MANIFEST_FORMAT, "generation": self.generation, **asdict(self.info),
               "files": {n: asdict(f) for n, f in self.files.items()}}
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> Manifest:
        try:
            doc = json.loads(raw)
            if doc.pop("format") != MANIFEST_FORMAT:
                raise ValueError("unknown manifest format")
            files = {n: FileEntry(**f) for n, f in doc.pop("files").items()}
            generation = doc.pop("generation")
            return cls(CheckpointInfo(**doc), generation, files)
        except (ValueError, KeyError, TypeError) as e:
            raise Internal(f"checkpoint manifest {key!r} is unreadable: {e}") from None


def tenant_segment(tenant: str) -> str:
    """The key segment of ``tenant``'s objects."""
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:32]


def manifest_key(tenant: str, p: CheckpointPath) -> str:
    return f"manifests/{tenant_segment(tenant)}/{p.run_id}/{p.kind}/{p.name}.json"


def blob_prefix(tenant: str, p: CheckpointPath, generation: str) -> str:
    return f"blobs/{tenant_segment(tenant)}/{p.run_id}/{p.kind}/{p.name}/{generation}/"


def owner_key(run_id: str) -> str:
    return f"runs/{run_id}.owner"


def new_generation(started: float) -> str:
    """The generation of a save that started at ``started`` (unix seconds)."""
    return f"{int(started * 1000):013d}-{secrets.token_hex(4)}"


def generation_time(generation: str) -> float | None:
    """When the save that made ``generation`` started (unix seconds); None if it is not one of ours."""
    ms, _, _ = generation.partition("-")
    return int(ms) / 1000 if ms.isdigit() else None


def read_manifest(store: ObjectStore, tenant: str, p: CheckpointPath) -> Manifest | None:
    """The manifest at ``p`` if ``tenant`` owns it (None: there is none, or it is another tenant's)."""
    key = manifest_key(tenant, p)
    try:
        m = Manifest.from_json(key, store.get(key))
    except KeyError:
        return None
    return m if m.info.tenant == tenant else None


def scan_manifests(store: ObjectStore, tenant: str, run_id: str) -> Iterator[Manifest]:
    """Every manifest (live or expired) of ``tenant`` (all tenants when empty) in one run (all when empty)."""
    prefix = "manifests/" + (f"{tenant_segment(tenant)}/" if tenant else "") + (f"{run_id}/" if run_id else "")
    for key in store.keys(prefix):
        try:
            m = Manifest.from_json(key, store.get(key))
        except KeyError:  # deleted since it was listed
            continue
        if not tenant or m.info.tenant == tenant:
            yield m


def delete_files(store: ObjectStore, m: Manifest) -> None:
    """Remove the files of ``m``'s generation."""
    prefix = m.blob_prefix()
    for name in m.files:
        store.delete(prefix + name)


class Replaced(Unavailable):
    """A checkpoint was replaced or deleted while it was being read (reading it again may succeed)."""


class Tally:
    """Size and sha256 of the chunks that pass through ``feed``."""

    __slots__ = ("sha", "size")

    def __init__(self) -> None:
        self.sha, self.size = hashlib.sha256(), 0

    def feed(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.sha.update(chunk)
            self.size += len(chunk)
            yield chunk

    def file(self) -> FileEntry:
        return FileEntry(self.size, self.sha.hexdigest())


def stream_files(store: ObjectStore, m: Manifest) -> Iterator[tuple[str, bytes]]:
    """Every file of ``m`` as (file name, chunk) pairs, file by file, each checked as by ``stream_file``."""
    for name, want in sorted(m.files.items()):
        for chunk in stream_file(store, m, name, want):
            yield name, chunk


def stream_file(store: ObjectStore, m: Manifest, name: str, want: FileEntry) -> Iterator[bytes]:
    """The chunks of file ``name`` of ``m``, checked against ``want`` after the last one."""
    key = m.blob_prefix() + name
    tally = Tally()
    try:
        yield from tally.feed(store.get_stream(key))
    except KeyError:
        latest = read_manifest(store, m.info.tenant, m.path)
        if latest is None or latest.generation != m.generation:
            raise Replaced(f"checkpoint {m.info.path} was replaced or deleted while it was read; "
                           "read it again") from None
        raise Internal(f"checkpoint {m.info.path}: stored object {key!r} is missing") from None
    got = tally.file()
    if got != want:
        raise Internal(f"checkpoint {m.info.path}: object {key!r} (file {name!r}) is corrupt ({got.size} "
                       f"bytes, sha256 {got.sha256[:12]}..., the manifest says {want.size} bytes, "
                       f"{want.sha256[:12]}...)")
