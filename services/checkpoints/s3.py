"""``S3Store``: the ``ObjectStore`` of ``s3://bucket/prefix`` URLs, through the ``minio`` client.

Owns: the S3 connection (endpoint, credentials, timeouts, retries) and the translation of S3's
answers into the store contract and Lathe's error model. Knows nothing of checkpoints: the key
layout and hashes are ``layout.py``'s, the commit protocol ``service.py``'s.

Configuration never comes from argv (a secret there is visible to every user of the machine):
``S3Config.from_env`` reads ``LATHE_S3_ENDPOINT`` (``http://host:port`` or ``https://host``),
``LATHE_S3_ACCESS_KEY``, ``LATHE_S3_SECRET_KEY``, ``LATHE_S3_REGION`` and ``LATHE_S3_PUBLIC_ENDPOINT``, each of
which overrides the same field (``endpoint``, ``access_key``, ``secret_key``, ``region``, ``public_endpoint``) of the
JSON file named by ``LATHE_S3_CREDENTIALS_FILE``.

Presigned URLs (``presign_get``) carry the host they were signed for, so they are signed for the address
*clients* reach the store at: ``public_endpoint``, when the service reaches the store at an address no client can
(an in-cluster MinIO behind its own Ingress); ``endpoint`` when it is unset (AWS S3, reached by everyone at one
address); and none at all with ``public_endpoint = "none"`` (clients then download through the gateway's HTTP door).

Errors: a missing key is ``KeyError`` (the store contract); refused credentials are
``PermissionDenied`` naming the endpoint and bucket; a missing bucket ``FailedPrecondition``; an
unreachable or failing server (connection refused or reset, timeouts, 5xx after the retries)
``Unavailable``, which callers may retry. Objects larger than ``part_bytes`` go up as multipart
uploads, which S3 makes visible only when complete (an interrupted one is aborted or never appears).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.error import MinioException, S3Error, ServerError

from lathe.errors import FailedPrecondition, Internal, InvalidArgument, PermissionDenied, Unavailable

from .store import CHUNK_BYTES, check_key

ENV_ENDPOINT = "LATHE_S3_ENDPOINT"
ENV_ACCESS_KEY = "LATHE_S3_ACCESS_KEY"
ENV_SECRET_KEY = "LATHE_S3_SECRET_KEY"
ENV_REGION = "LATHE_S3_REGION"
ENV_PUBLIC_ENDPOINT = "LATHE_S3_PUBLIC_ENDPOINT"
ENV_CREDENTIALS_FILE = "LATHE_S3_CREDENTIALS_FILE"
NO_URLS = "none"
"""The ``public_endpoint`` of a store whose objects no client can reach: it presigns no URL."""
DEFAULT_REGION = "us-east-1"
"""The region a URL for ``public_endpoint`` is signed in when ``region`` is unset (S3's, MinIO's and SeaweedFS's
default): a presigning client that knows its region asks the (possibly unreachable) public endpoint nothing."""
MIN_PART_BYTES = 5 << 20  # S3's smallest multipart part
_DENIED = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})


@dataclass(frozen=True, slots=True)
class S3Config:
    """Where and how to reach one bucket. ``prefix`` is prepended to every key ("" or ending in '/')."""

    endpoint: str  # http://host:port or https://host[:port]
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    prefix: str = ""
    region: str | None = None
    public_endpoint: str = ""  # where clients reach the store, for presigned URLs ("": endpoint; NO_URLS: none)
    part_bytes: int = 16 << 20  # multipart part size (and the most one upload holds in memory per thread)
    parallel_uploads: int = 3
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 120.0
    retries: int = 2  # per request, on connection errors and 5xx answers

    def __post_init__(self) -> None:
        if not _is_endpoint(self.endpoint):
            raise InvalidArgument(f"S3 endpoint {self.endpoint!r} must be http://host[:port] or https://host[:port] "
                                  f"(set {ENV_ENDPOINT})")
        if self.public_endpoint not in ("", NO_URLS) and not _is_endpoint(self.public_endpoint):
            raise InvalidArgument(f"S3 public endpoint {self.public_endpoint!r} must be http://host[:port], "
                                  f"https://host[:port] or {NO_URLS!r} (set {ENV_PUBLIC_ENDPOINT})")
        if not self.bucket:
            raise InvalidArgument("S3 bucket is empty: the store URL must be s3://<bucket>[/<prefix>]")
        if not (self.access_key and self.secret_key):
            raise InvalidArgument(f"S3 credentials for {self.endpoint} are missing: set {ENV_ACCESS_KEY} and "
                                  f"{ENV_SECRET_KEY}, or name a JSON file with them in {ENV_CREDENTIALS_FILE}")
        if self.prefix and not self.prefix.endswith("/"):
            raise InvalidArgument(f"S3 key prefix {self.prefix!r} must end with '/'")
        if self.part_bytes < MIN_PART_BYTES:
            raise InvalidArgument(f"part_bytes = {self.part_bytes} must be >= {MIN_PART_BYTES} (S3's minimum)")

    @classmethod
    def from_env(cls, url: str, env: Mapping[str, str] = os.environ) -> S3Config:
        """The config of ``s3://bucket[/prefix]`` with endpoint and credentials from ``env`` (see the module doc)."""
        parsed = urlparse(url)
        if parsed.scheme != "s3":
            raise InvalidArgument(f"store URL {url!r} must start with s3://")
        doc: dict[str, str] = {}
        if env.get(ENV_CREDENTIALS_FILE):
            doc = _read_credentials_file(Path(env[ENV_CREDENTIALS_FILE]))
        for key, var in (("endpoint", ENV_ENDPOINT), ("access_key", ENV_ACCESS_KEY),
                         ("secret_key", ENV_SECRET_KEY), ("region", ENV_REGION),
                         ("public_endpoint", ENV_PUBLIC_ENDPOINT)):
            if env.get(var):
                doc[key] = env[var]
        if "endpoint" not in doc:
            raise InvalidArgument(f"store {url!r}: no S3 endpoint; set {ENV_ENDPOINT} (e.g. http://127.0.0.1:8333)")
        prefix = parsed.path.strip("/")
        return cls(endpoint=doc["endpoint"], bucket=parsed.netloc, access_key=doc.get("access_key", ""),
                   secret_key=doc.get("secret_key", ""), prefix=f"{prefix}/" if prefix else "",
                   region=doc.get("region"), public_endpoint=doc.get("public_endpoint", ""))


def _is_endpoint(url: str) -> bool:
    """Whether ``url`` is ``http://host[:port]`` or ``https://host[:port]`` (a trailing slash allowed)."""
    parsed = urlparse(url)
    return parsed.scheme in ("http", "https") and bool(parsed.netloc) and not parsed.path.strip("/")


def _read_credentials_file(path: Path) -> dict[str, str]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{ENV_CREDENTIALS_FILE} {str(path)!r} is not a readable JSON file: {e}") from None
    allowed = {"endpoint", "access_key", "secret_key", "region", "public_endpoint"}
    if not isinstance(doc, dict) or not set(doc) <= allowed or not all(isinstance(v, str) for v in doc.values()):
        raise InvalidArgument(f"{ENV_CREDENTIALS_FILE} {str(path)!r} must be a JSON object of strings with keys "
                              f"among {sorted(allowed)}")
    return doc


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of chunks; ``read(n)`` returns exactly ``n`` bytes until the end
    (minio's multipart upload reads one part per call)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            if not self._pending:
                nxt = next(self._chunks, None)
                if nxt is None:
                    break
                self._pending = memoryview(nxt)
                continue
            take = len(self._pending) if size < 0 else min(size - len(out), len(self._pending))
            out += self._pending[:take]
            self._pending = self._pending[take:]
        return bytes(out)


class S3Store:
    """An ``ObjectStore`` in one S3 bucket (under ``cfg.prefix``); thread-safe (minio's pool is)."""

    def __init__(self, cfg: S3Config) -> None:
        self.cfg = cfg
        parsed = urlparse(cfg.endpoint)
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=cfg.connect_timeout_s, read=cfg.read_timeout_s), maxsize=16,
            retries=urllib3.Retry(total=cfg.retries, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]))
        self.client = Minio(parsed.netloc, access_key=cfg.access_key, secret_key=cfg.secret_key,
                            secure=parsed.scheme == "https", region=cfg.region, http_client=http)
        self.signer: Minio | None = self.client  # signs presigned URLs: for the address clients reach
        if cfg.public_endpoint == NO_URLS:
            self.signer = None
        elif cfg.public_endpoint:
            public = urlparse(cfg.public_endpoint)
            self.signer = Minio(public.netloc, access_key=cfg.access_key, secret_key=cfg.secret_key,
                                secure=public.scheme == "https", region=cfg.region or DEFAULT_REGION)

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        return cls(S3Config.from_env(url))

    @contextlib.contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        """Translate what S3 or the connection raised while ``action``-ing ``key``."""
        where = f"S3 endpoint {self.cfg.endpoint} bucket {self.cfg.bucket!r}"
        try:
            yield
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchObject"):
                raise KeyError(key) from None
            if e.code in _DENIED:
                raise PermissionDenied(f"{where}: access denied ({e.code}) to {action} {key!r}; check the "
                                       f"credentials ({ENV_ACCESS_KEY} / {ENV_SECRET_KEY} or "
                                       f"{ENV_CREDENTIALS_FILE})") from None
            if e.code == "NoSuchBucket":
                raise FailedPrecondition(f"{where}: the bucket does not exist (create it first)") from None
            raise Internal(f"{where}: {action} {key!r} failed: {e.code}: {e.message}") from None
        except (ServerError, MinioException, urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(f"{where} is unavailable ({type(e).__name__}: {e}) to {action} {key!r}; "
                              "retry later") from None

    def _key(self, key: str) -> str:
        check_key(key)
        return self.cfg.prefix + key

    def put(self, key: str, data: bytes) -> None:
        with self._errors("write", key):
            self.client.put_object(self.cfg.bucket, self._key(key), io.BytesIO(data), len(data))

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> None:
        with self._errors("write", key):
            self.client.put_object(self.cfg.bucket, self._key(key), _ChunkReader(chunks), -1,
                                   part_size=self.cfg.part_bytes, num_parallel_uploads=self.cfg.parallel_uploads)

    def get(self, key: str) -> bytes:
        return b"".join(self.get_stream(key))

    def get_stream(self, key: str) -> Iterator[bytes]:
        with self._errors("read", key):
            response = self.client.get_object(self.cfg.bucket, self._key(key))
            try:
                yield from response.stream(CHUNK_BYTES)
            finally:
                response.close()
                response.release_conn()

    def keys(self, prefix: str) -> list[str]:
        full = self.cfg.prefix + prefix
        with self._errors("list", prefix or "/"):
            names = [o.object_name for o in self.client.list_objects(self.cfg.bucket, prefix=full, recursive=True)]
        return sorted(n[len(self.cfg.prefix):] for n in names if n is not None)

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self.client.remove_object(self.cfg.bucket, self._key(key))

    def presign_get(self, key: str, expires_s: int) -> str | None:
        if self.signer is None:
            return None
        with self._errors("sign a URL for", key):
            return self.signer.presigned_get_object(self.cfg.bucket, self._key(key),
                                                    expires=timedelta(seconds=expires_s))

    def exists(self, key: str) -> bool:
        try:
            with self._errors("stat", key):
                self.client.stat_object(self.cfg.bucket, self._key(key))
        except KeyError:
            return False
        return True
