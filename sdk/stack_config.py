"""``StackConfig``: the settings of the embedded stack (``lathe.stack.Stack``), checked once when built.

Owns what a stack is told: its addresses, models, store, pools' threads and dtype, the gateway's files, the
supervision budget. ``lathe serve`` builds one from its flags, tests and examples build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    trainer_dtype: str = "float32"  # both pools' base weights: float32, bfloat16 or auto (lathe serve's default)
    invariant: bool = True
    api_keys_file: Path | None = None  # KEY=TENANT lines (None: open mode, every key its own tenant)
    quotas_file: Path | None = None  # per-tenant quotas, JSON or .toml (None: the gateway's defaults)
    tls_cert: Path | None = None  # PEM certificate and key: both public doors serve TLS
    tls_key: Path | None = None
    trainer_args: tuple[str, ...] = ()  # extra flags for `python -m lathe.trainer`
    sampler_args: tuple[str, ...] = ()  # extra flags for `python -m lathe.sampler` (e.g. --engine sglang ...)
    gateway_args: tuple[str, ...] = ()  # extra flags for `python -m lathe.gateway`
    trainer_ranks: int = 1  # processes in the trainer pool: one service, whose rank 0 starts the others
    log_dir: Path | None = None
    # the gateway's control-plane database (sqlite:///FILE, postgresql+psycopg://...); "": a SQLite file of this
    # stack's own under cache_root/control, so a restarted gateway finds its sessions, runs and futures
    db_url: str = ""
    gateways: int = 1  # gateway replicas over the one control-plane database (the first on the ports above)
    supervise: bool = True  # restart a child that exits while the stack runs
    wait_pools: bool = True  # start() returns once trainer and sampler have loaded and self-checked their models
    metrics: bool = False  # every child serves Prometheus /metrics on a free loopback port (Stack.metrics_urls)
    restart_budget: int = 3  # restarts per child within restart_window_s; one more exit stops the stack
    restart_window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the embedded stack listens on loopback only, not {self.host!r}")
        if self.trainer_ranks < 1:
            raise ValueError(f"trainer_ranks = {self.trainer_ranks} must be >= 1")
        if self.gateways < 1:
            raise ValueError(f"gateways = {self.gateways} must be >= 1")
        if self.restart_budget < 0 or self.restart_window_s <= 0:
            raise ValueError(f"restart_budget = {self.restart_budget} must be >= 0 and restart_window_s = "
                             f"{self.restart_window_s} > 0")
