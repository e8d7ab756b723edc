"""A synchronous, torch-free client of ``lathe.v1.Checkpoints`` (used by the trainer, the sampler and the
``lathe`` CLI).

Checkpoint bytes travel as streams of ``CHUNK_BYTES`` pieces (``PutStream`` / ``GetStream``), so no
message and no buffer in between holds a whole checkpoint; ``download`` writes files to disk as the
chunks arrive. Failed calls raise the ``lathe.errors`` class the server raised (NotFound, ...).

Reads go straight to the store where it signs URLs (S3): ``Locate`` names each file's presigned GET URL,
size and sha256, and this client fetches the bytes itself and checks them, so they cross no service in
between. ``get`` reads up to ``READ_THREADS`` files at once over pooled connections, each in one read into one
``bytes`` that it then hashes. Where the store signs none (a directory), or the URLs are unreachable from this
host (then for the rest of this client's life), the files come through ``GetStream``.

Deadlines and retries: every try of a call carries a deadline (``timeout_s``). A call that fails
``Unavailable`` (the service is restarting after a crash, or its store is briefly down) is tried again with
capped exponential backoff for at most ``Retry.retry_for_s``, then fails with ``Unavailable`` naming the
service and the call. Retried: ``stat``, ``list``, ``get`` (reads, idempotent), the opening of
``download`` (before any byte is written) and ``put`` as a whole (the service commits a save by writing
its manifest last, so a broken try leaves nothing visible; when a try committed but its answer was lost,
the next one finds the checkpoint there: if it holds exactly this save's files and metadata, the save
succeeded). ``delete`` is not retried (a repeat of one that landed would answer NotFound).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import grpc
import urllib3
from google.protobuf.message import Message

from lathe.backoff import Backoff
from lathe.channels import CHANNEL_OPTIONS, reconnect_options
from lathe.errors import AlreadyExists, Internal, Unavailable, from_rpc_error
from lathe.runtime.internal_auth import internal_channel
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc

from .layout import CheckpointInfo, CheckpointList
from .paths import CheckpointPath
from .store import CHUNK_BYTES

T = TypeVar("T")
log = logging.getLogger("lathe.checkpoints.client")
URL_LIFETIME_S = 900  # how long the presigned URLs of one read stay valid
READ_THREADS = 4  # files of one checkpoint read from the store at once


@dataclass(frozen=True, slots=True)
class Retry:
    """How long calls that fail ``Unavailable`` are tried again: after ``first_backoff_s``, doubling up to
    ``max_backoff_s``, until ``retry_for_s`` has passed since the first try (0: never retry)."""

    retry_for_s: float = 60.0
    first_backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.first_backoff_s <= self.max_backoff_s or self.retry_for_s < 0:
            raise ValueError(f"Retry needs 0 < first_backoff_s <= max_backoff_s and retry_for_s >= 0, got {self}")


def _info(msg: cpb.CheckpointInfo) -> CheckpointInfo:
    return CheckpointInfo(**{f.name: getattr(msg, f.name) for f in fields(CheckpointInfo)})


def _verify(path: str, name: str, f: cpb.StoredFile, size: int, sha256: str) -> None:
    """Raise ``Internal`` naming the object unless file ``name`` of ``path``, read from ``f.url``, is ``size``
    bytes with ``sha256`` as the manifest says."""
    if (size, sha256) != (f.size, f.sha256):
        obj = unquote(urlparse(f.url).path)
        raise Internal(f"checkpoint {path}: object {obj!r} (file {name!r}) read from the store is corrupt "
                       f"({size} bytes, sha256 {sha256[:12]}..., the manifest says {f.size} bytes, "
                       f"{f.sha256[:12]}...)")


class CheckpointsClient:
    """One channel to a checkpoints server at ``target`` (``host:port``); safe to share between threads.
    Every call carries this process's internal token (``lathe.runtime.internal_auth``)."""

    def __init__(self, target: str, *, timeout_s: float = 600.0, retry: Retry = Retry(),
                 direct_reads: bool = True) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry
        self.direct_reads = direct_reads  # read from presigned store URLs when the service hands them out
        # direct reads: one pooled connection and one reading thread per file at a time
        self._http = urllib3.PoolManager(maxsize=READ_THREADS, retries=False,
                                         timeout=urllib3.Timeout(connect=5.0, read=timeout_s))
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="checkpoints-read")
        # reconnect to a restarted service as soon as the retries would
        self._channel = internal_channel(target, [*CHANNEL_OPTIONS,
                                                  *reconnect_options(retry.max_backoff_s, retry.max_backoff_s)])
        self._stub = cpb_grpc.CheckpointsStub(self._channel)

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()``, tried again while it fails ``Unavailable``, within ``self.retry``."""
        backoff = Backoff(self.retry.first_backoff_s, self.retry.max_backoff_s, self.retry.retry_for_s)
        while True:
            try:
                return attempt()
            except Unavailable as e:
                if (pause := backoff.next()) is None:
                    raise Unavailable(f"checkpoints service at {self.target} stayed unavailable for "
                                      f"{self.retry.retry_for_s:g} s (retry_for_s) while trying to {what}: "
                                      f"{e.message}") from None
            time.sleep(pause)

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: Message) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: Mapping[str, bytes],
            metadata_json: str = "", ttl_seconds: int = 0, overwrite: bool = False, max_tenant_bytes: int = 0
            ) -> str:
        """Save a checkpoint (streamed, retried as a whole); returns its path ``tinker://<run_id>/<kind>/<name>``."""
        path = str(CheckpointPath(run_id, kind, name))
        header = cpb.PutCheckpointRequest(tenant=tenant, run_id=run_id, kind=kind, name=name,
                                          metadata_json=metadata_json, ttl_seconds=ttl_seconds, overwrite=overwrite,
                                          max_tenant_bytes=max_tenant_bytes)

        def messages() -> Iterator[cpb.PutCheckpointChunk]:
            yield cpb.PutCheckpointChunk(header=header)
            for file_name, data in sorted(files.items()):
                view = memoryview(data)
                for start in range(0, max(len(view), 1), CHUNK_BYTES):
                    yield cpb.PutCheckpointChunk(chunk=cpb.FileChunk(file=file_name,
                                                                     data=bytes(view[start:start + CHUNK_BYTES])))
            yield cpb.PutCheckpointChunk(done=True)

        tries = 0

        def attempt() -> str:
            nonlocal tries
            tries += 1
            try:
                return self._call(self._stub.PutStream, messages()).path
            except AlreadyExists:
                if tries > 1 and self._holds(tenant, path, files, metadata_json):
                    return path  # an earlier try committed; its answer was lost
                raise

        return self._retrying(f"save {path}", attempt)

    def _holds(self, tenant: str, path: str, files: Mapping[str, bytes], metadata_json: str) -> bool:
        """Whether the checkpoint at ``path`` is exactly ``files`` with ``metadata_json``."""
        if self.stat(tenant=tenant, path=path).metadata_json != metadata_json:
            return False
        stored = self.get(tenant=tenant, path=path)
        return stored.keys() == files.keys() and all(stored[n] == bytes(files[n]) for n in files)

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]:
        """The checkpoint's files, each verified against its sha256 (retried as a whole). From the store's URLs
        the files are read in parallel (``_read_url``)."""

        def attempt() -> dict[str, bytes]:
            located = self._locate(tenant, path)
            if located is not None:
                files = located[1]
                read = list(self._readers.map(lambda item: self._read_url(path, *item), files.items()))
                if all(data is not None for data in read):
                    return dict(zip(files, read, strict=True))
            _, sizes, chunks = self._get_stream(tenant, path)
            parts: dict[str, list[bytes]] = {n: [] for n in sizes}
            for name, chunk in chunks:
                parts[name].append(chunk)
            return {n: b"".join(p) for n, p in parts.items()}

        return self._retrying(f"load {path}", attempt)

    def download(self, *, tenant: str, path: str, directory: Path,
                 on_bytes: Callable[[int, int], None] | None = None) -> CheckpointInfo:
        """Write the checkpoint's files into ``directory`` as they arrive; ``on_bytes(n, total)`` after each
        chunk. Files appear under their names only once the whole stream has been verified."""
        info, sizes, chunks = self._retrying(f"load {path}", lambda: self._open(tenant, path))
        directory.mkdir(parents=True, exist_ok=True)
        partial = {n: directory / f".{n}.partial" for n in sizes}
        try:
            files = {n: p.open("wb") for n, p in partial.items()}
            try:
                for name, chunk in chunks:
                    files[name].write(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk), info.size_bytes)
            finally:
                for f in files.values():
                    f.close()
            for name, p in partial.items():
                os.replace(p, directory / name)
        finally:
            for p in partial.values():
                p.unlink(missing_ok=True)
        return info

    def _open(self, tenant: str, path: str) -> tuple[CheckpointInfo, dict[str, int], Iterator[tuple[str, bytes]]]:
        """Start a read: the info and file sizes now, then (file name, chunk) pairs, each file checked against its
        size and sha256 by the time the iterator moves past its last chunk. Straight from the store when it signs
        URLs, else a GetStream."""
        located = self._locate(tenant, path)
        if located is not None:
            info, files = located
            first = self._fetch(path, *next(iter(files.items())))
            if first is not None:
                return info, {n: f.size for n, f in files.items()}, self._direct_chunks(path, files, first)
        return self._get_stream(tenant, path)

    def _locate(self, tenant: str, path: str) -> tuple[CheckpointInfo, dict[str, cpb.StoredFile]] | None:
        """The checkpoint's info and its files (in name order) with their URLs; None when this client reads
        through the service (the store signs no URLs, or they proved unreachable from here)."""
        if not self.direct_reads:
            return None
        located = self._call(self._stub.Locate, cpb.LocateRequest(tenant=tenant, path=path,
                                                                  expires_in_s=URL_LIFETIME_S))
        files = dict(sorted(located.files.items()))
        return (_info(located.info), files) if files and all(f.url for f in files.values()) else None

    def _fetch(self, path: str, name: str, f: cpb.StoredFile) -> urllib3.BaseHTTPResponse | None:
        """Open the GET of ``f.url``; None (and no more direct reads) when its host cannot be reached."""
        try:
            res = self._http.request("GET", f.url, preload_content=False)
        except urllib3.exceptions.HTTPError as e:
            log.warning("store URLs are unreachable from here (%s); reading through %s from now on", e, self.target)
            self.direct_reads = False
            return None
        if res.status != 200:
            res.release_conn()
            raise Unavailable(f"reading file {name!r} of {path} from the store answered HTTP {res.status} (replaced "
                              "or deleted meanwhile?); read it again")
        return res

    def _read_url(self, path: str, name: str, f: cpb.StoredFile) -> bytes | None:
        """File ``name`` from its URL, verified; None when the store is unreachable (see ``_fetch``). One read of
        the whole body fills one ``bytes`` straight from the socket (no chunks to copy or join), then it is hashed;
        ``get`` runs one per file in parallel, so one file's hash overlaps the others' reads."""
        res = self._fetch(path, name, f)
        if res is None:
            return None
        try:
            data = res.read()
        except urllib3.exceptions.HTTPError as e:
            raise Unavailable(f"reading file {name!r} of {path} from the store broke off: {e}") from None
        finally:
            res.release_conn()
        _verify(path, name, f, len(data), hashlib.sha256(data).hexdigest())
        return data

    def _direct_chunks(self, path: str, files: Mapping[str, cpb.StoredFile], first: urllib3.BaseHTTPResponse
                       ) -> Iterator[tuple[str, bytes]]:
        """Every file's chunks from its URL (``first``: the open response of the first file), each verified."""
        for name, f in files.items():
            res = first if first is not None else self._fetch(path, name, f)
            first = None
            if res is None:
                raise Unavailable(f"the store became unreachable while reading {path}; read it again")
            sha, size = hashlib.sha256(), 0
            try:
                for chunk in res.stream(CHUNK_BYTES):
                    sha.update(chunk)
                    size += len(chunk)
                    yield name, chunk
            except urllib3.exceptions.HTTPError as e:
                raise Unavailable(f"reading file {name!r} of {path} from the store broke off: {e}") from None
            finally:
                res.release_conn()
            _verify(path, name, f, size, sha.hexdigest())

    def _get_stream(self, tenant: str, path: str
                    ) -> tuple[CheckpointInfo, dict[str, int], Iterator[tuple[str, bytes]]]:
        """Start a GetStream: its header (info, file sizes) now, then (file name, chunk) pairs."""
        stream = self._stub.GetStream(cpb.CheckpointRef(tenant=tenant, path=path), timeout=self.timeout_s)
        try:
            header = next(stream).header
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

        def chunks() -> Iterator[tuple[str, bytes]]:
            try:
                for msg in stream:
                    yield msg.chunk.file, msg.chunk.data
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None

        return _info(header.info), dict(header.file_sizes), chunks()

    def stat(self, *, tenant: str, path: str) -> CheckpointInfo:
        ref = cpb.CheckpointRef(tenant=tenant, path=path)
        return _info(self._retrying(f"stat {path}", lambda: self._call(self._stub.Stat, ref)))

    def list(self, *, tenant: str, run_id: str = "", limit: int = 0, offset: int = 0) -> CheckpointList:
        """The tenant's live checkpoints (of one run, or all), oldest first; ``limit`` 0 = no limit."""
        req = cpb.ListCheckpointsRequest(tenant=tenant, run_id=run_id, limit=limit, offset=offset)
        res = self._retrying(f"list the checkpoints of {run_id or 'every run'}",
                             lambda: self._call(self._stub.List, req))
        return CheckpointList([_info(c) for c in res.checkpoints], res.total_count)

    def delete(self, *, tenant: str, path: str) -> None:
        self._call(self._stub.Delete, cpb.CheckpointRef(tenant=tenant, path=path))

    def close(self) -> None:
        self._channel.close()
        self._readers.shutdown()
        self._http.clear()

    def __enter__(self) -> CheckpointsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
