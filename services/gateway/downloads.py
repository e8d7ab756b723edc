"""Checkpoint downloads on the Tinker HTTP door: Tinker's external weights (export, signed URLs, the files).

In: ``save_weights_external`` (a sampler snapshot of the run, ``sampler_weights/<name>.export``, saved by the
trainer as usual with the request's ``ExportNote`` in its user metadata, then turned into
``tinker://<run>/external_weights/<name>`` by the checkpoints service's ``Export`` when its future is retrieved, or
by the next ``external_weights_urls`` if a gateway restart lost that moment: its PEFT files, age-encrypted when the
caller names recipients, under the tenant's byte quota; the snapshot is deleted then), ``external_weights_urls``
(the owner's API key) and, later, a bare GET of one URL (``urllib`` sends no key). Out: one URL per file, valid
until ``expires``: the store's own presigned GET URL where it signs them (S3, from the checkpoints service's
``Locate``), else a URL of this door, ``/api/v1/checkpoint_files/<token>``, whose token carries (tenant, path, file,
expiry) and an HMAC-SHA256 of them under the gateway's URL key; a GET of it streams that one file out of the
checkpoints service (``GetStream``, verified there). An expired or altered token is refused with 403 and says which.

Owns: the URL key, derived from the stack's internal secret so that every gateway replica accepts the URLs of the
others (a random key of this process when there is none). Never touches stored bytes at rest, and answers another
tenant's checkpoint as the checkpoints service does: 404, as if it were missing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import grpc
from starlette.responses import StreamingResponse

from lathe.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, from_rpc_error
from lathe.runtime.internal_auth import load_token
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb

URL_LIFETIME_S = 3600  # how long the URLs of one external_weights_urls answer stay valid
STAGING_TTL_S = 3600  # the sampler snapshot an export is made from lives at most this long
STAGING_SUFFIX = ".export"  # its name: the export's, plus this
EXPORT_NOTE_KEY = "lathe_export"  # the user-metadata key of its ExportNote
FILES_ROUTE = "/checkpoint_files/{token}"
EXTERNAL_KIND = "external_weights"
_CALL_TIMEOUT_S = 120.0


class UrlSigner:
    """Tokens for ``FILES_ROUTE``: ``base64url(json [tenant, path, file, expires_at]) . base64url(hmac)``."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        if len(key) < 16:
            raise ValueError("the URL key must be at least 16 bytes")
        self._key = key
        self.clock = clock

    @classmethod
    def from_secret(cls, secret: str) -> UrlSigner:
        """The signer of the stack whose internal secret is ``secret`` (a random key when it is "")."""
        if not secret:
            return cls(secrets.token_bytes(32))
        return cls(hmac.digest(secret.encode(), b"lathe checkpoint download URL key", "sha256"))

    def _mac(self, payload: bytes) -> bytes:
        return hmac.digest(self._key, payload, "sha256")

    def sign(self, tenant: str, path: str, file: str, expires_at: int) -> str:
        payload = json.dumps([tenant, path, file, expires_at], separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def verify(self, token: str) -> tuple[str, str, str]:
        """(tenant, path, file) of a token this key signed that has not expired; ``PermissionDenied`` otherwise."""
        body, _, mac = token.partition(".")
        try:
            payload, given = _unb64(body), _unb64(mac)
        except (ValueError, binascii.Error):
            raise PermissionDenied("download URL is malformed (its token does not decode)") from None
        if not hmac.compare_digest(self._mac(payload), given):
            raise PermissionDenied("download URL signature does not match (the URL was altered, or signed by another "
                                   "deployment)")
        tenant, path, file, expires_at = json.loads(payload)
        if self.clock() >= expires_at:
            raise PermissionDenied(f"download URL expired at unix time {expires_at}; ask for new URLs "
                                   "(external_weights_urls)")
        return tenant, path, file


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class ExportNote:
    """What a ``save_weights_external`` request asked for. It travels in the sampler snapshot's user metadata
    (``EXPORT_NOTE_KEY``), so the export can be built from the snapshot alone, by any gateway, after a restart."""

    name: str
    ttl_seconds: int
    age_recipients: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "ttl_seconds": self.ttl_seconds,
                           "age_recipients": list(self.age_recipients)})

    @classmethod
    def of_snapshot(cls, info: cpb.CheckpointInfo) -> ExportNote | None:
        """The note a staging snapshot carries (the trainer keeps user metadata under ``user_metadata``); None
        for any other checkpoint, and for a note this door did not write."""
        try:
            doc = json.loads(json.loads(info.metadata_json or "{}")["user_metadata"][EXPORT_NOTE_KEY])
            return cls(str(doc["name"]), int(doc["ttl_seconds"]), tuple(map(str, doc["age_recipients"])))
        except (ValueError, KeyError, TypeError):
            return None


class Downloads:
    """The download calls of the door, over the checkpoints service's stub; ``quota(tenant)`` is the tenant's
    checkpoint byte quota, which an export obeys as a save does."""

    def __init__(self, checkpoints: cpb_grpc.CheckpointsStub, signer: UrlSigner | None = None,
                 quota: Callable[[str], int] = lambda tenant: 0) -> None:
        self.checkpoints = checkpoints
        self.signer = signer or UrlSigner.from_secret(load_token())
        self.quota = quota

    async def _call(self, rpc: Any, request: Any) -> Any:  # any unary stub method
        try:
            return await rpc(request, timeout=_CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    @staticmethod
    def staging_save(model_id: str, seq_id: int, note: ExportNote) -> pb.SaveRequest:
        """The save of the sampler snapshot an export is made from: ``sampler_weights/<name>.export``, carrying
        ``note``, living at most ``STAGING_TTL_S`` (and never recorded as the run's last sampler checkpoint)."""
        return pb.SaveRequest(model_id=model_id, seq_id=seq_id, name=f"{note.name}{STAGING_SUFFIX}",
                              kind="sampler_weights", ttl_seconds=STAGING_TTL_S, overwrite=True,
                              user_metadata={EXPORT_NOTE_KEY: note.to_json()})

    @staticmethod
    def maybe_staging(path: str) -> bool:
        """Whether ``path`` may be an export's staging snapshot (``finish_export`` checks its note)."""
        return path.split("/")[-2:-1] == ["sampler_weights"] and path.endswith(STAGING_SUFFIX)

    async def finish_export(self, tenant: str, staged_path: str) -> dict[str, Any] | None:
        """Build the export the staging snapshot at ``staged_path`` asks for, then delete the snapshot; None when
        the checkpoint there carries no ``ExportNote``. Safe to repeat and to race (a retried ``retrieve_future``,
        an ``external_weights_urls`` rebuilding it): once the snapshot is gone the export made from it is
        answered. An export the quota refuses deletes the snapshot too, so it leaves nothing behind."""
        run_id, _, staged_name = staged_path.removeprefix("tinker://").split("/")
        path = f"tinker://{run_id}/{EXTERNAL_KIND}/{staged_name.removesuffix(STAGING_SUFFIX)}"
        staged_ref = cpb.CheckpointRef(tenant=tenant, path=staged_path)
        try:
            note = ExportNote.of_snapshot(await self._call(self.checkpoints.Stat, staged_ref))
            if note is None:
                return None
            info = await self._call(self.checkpoints.Export, cpb.ExportRequest(
                tenant=tenant, source_path=staged_path, name=note.name, ttl_seconds=note.ttl_seconds,
                age_recipients=note.age_recipients, max_tenant_bytes=self.quota(tenant)))
        except NotFound:
            info = await self._call(self.checkpoints.Stat, cpb.CheckpointRef(tenant=tenant, path=path))
            if json.loads(info.metadata_json or "{}").get("exported_from") != staged_path:
                raise
        except ResourceExhausted:
            with contextlib.suppress(NotFound):
                await self._call(self.checkpoints.Delete, staged_ref)
            raise
        else:
            with contextlib.suppress(NotFound):
                await self._call(self.checkpoints.Delete, staged_ref)
        return {"path": info.path, "size_bytes": info.size_bytes, "type": "save_weights_external"}

    async def urls(self, tenant: str, path: str, base_url: str) -> dict[str, Any]:
        """``{"urls": {file: url}, "expires": ISO time}`` for the caller's external_weights checkpoint."""
        if path.split("/")[-2:-1] != [EXTERNAL_KIND]:
            raise InvalidArgument(f"{path!r} is not an external weights checkpoint (tinker://<run>/{EXTERNAL_KIND}/"
                                  "<name>); save one with save_weights_external")
        locate = cpb.LocateRequest(tenant=tenant, path=path, expires_in_s=URL_LIFETIME_S)
        try:
            located = await self._call(self.checkpoints.Locate, locate)
        except NotFound:  # not built yet (its gateway restarted before the future was retrieved)?
            run_id, _, name = path.removeprefix("tinker://").split("/")
            if await self.finish_export(tenant, f"tinker://{run_id}/sampler_weights/{name}{STAGING_SUFFIX}") is None:
                raise
            located = await self._call(self.checkpoints.Locate, locate)
        files = dict(located.files)
        if files and all(f.url for f in files.values()):
            return {"urls": {n: f.url for n, f in files.items()}, "expires": _iso(located.expires_at)}
        expires_at = int(self.signer.clock()) + URL_LIFETIME_S
        root = base_url.rstrip("/")
        return {"urls": {n: f"{root}{FILES_ROUTE.format(token=quote(self.signer.sign(tenant, path, n, expires_at)))}"
                         for n in files}, "expires": _iso(expires_at)}

    async def file(self, token: str) -> StreamingResponse:
        """The one file a signed token names, streamed as the checkpoints service verifies it."""
        tenant, path, name = self.signer.verify(token)
        stream = self.checkpoints.GetStream(cpb.CheckpointRef(tenant=tenant, path=path), timeout=_CALL_TIMEOUT_S)
        try:
            header = (await stream.read()).header
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if name not in header.file_sizes:
            stream.cancel()
            raise NotFound(f"checkpoint {path} has no file {name!r} (replaced since the URL was signed?)")

        async def body() -> AsyncIterator[bytes]:
            try:
                while (msg := await stream.read()) is not grpc.aio.EOF:
                    if msg.chunk.file == name:
                        yield msg.chunk.data
                    elif msg.chunk.file > name:  # files come in name order: this one is complete
                        break
            finally:
                stream.cancel()

        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"content-length": str(header.file_sizes[name])})


def export_note(recipients: Sequence[str] | None, name: str, ttl_seconds: int | None) -> ExportNote:
    """The ``ExportNote`` of a ``save_weights_external`` body's fields."""
    if recipients is not None and not (1 <= len(recipients) <= 10 and all(isinstance(r, str) for r in recipients)):
        raise InvalidArgument("age_encryption_recipients must be 1 to 10 key strings, or left out")
    return ExportNote(name, ttl_seconds or 0, tuple(recipients or ()))


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat()

