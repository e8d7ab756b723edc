"""How a ``python -m lathe.trainer`` process takes its place in a trainer pool of several ranks.

Two ways to form a pool of N:

- one process per rank, told its place (``--rank``, ``--world-size``, ``--master-addr``, ``--master-port``, or
  RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as a Kubernetes StatefulSet or torchrun sets them);
- ``--world-size N`` without a rank (``lathe serve --trainer-ranks N``): this process is rank 0 and starts ranks
  1..N-1 itself on this machine, on a free master port (``start_followers``).

Rank 0 leads (gRPC, queues, planning: ``lathe.trainer.engine``). A follower (``Follower``) forms the pool, then
applies the leader's plans until the leader says stop (exit 0) or the pool breaks. When the pool breaks every
rank exits with ``EXIT_RANK_LOST``: the leader after answering its operations (``exit_soon``), its local
followers with it; whoever supervises the ranks (the embedded stack, a StatefulSet) starts them again, they
rendezvous anew, and the gateway rebuilds each run from its recovery snapshot and its ledger.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from lathe.models.catalog import ModelCatalog
from lathe.trainer.dist import EXIT_RANK_LOST, PoolConfig, PoolFormationError, RankLost, free_port, join
from lathe.trainer.engine import TrainerConfig, TrainerEngine

log = logging.getLogger("lathe.trainer")

EXIT_GRACE_S = 1.0  # how long a leader that lost its pool keeps answering (UNAVAILABLE) before it exits


def add_arguments(ap: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The pool flags; their defaults come from ``env`` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)."""
    d = PoolConfig()
    ap.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", d.world_size)),
                    help="ranks in this trainer pool (default: WORLD_SIZE or 1)")
    ap.add_argument("--rank", type=int, default=int(env["RANK"]) if "RANK" in env else None,
                    help="this process's rank (default: RANK; unset with --world-size > 1: rank 0, which starts "
                         "the other ranks on this machine)")
    ap.add_argument("--master-addr", default=env.get("MASTER_ADDR", d.master_addr),
                    help="rank 0's address for the rendezvous (default: MASTER_ADDR or 127.0.0.1)")
    ap.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT", 0)),
                    help="rendezvous port on rank 0 (default: MASTER_PORT; 0: a free port, local pools only)")
    ap.add_argument("--rank-timeout-s", type=float, default=d.timeout_s,
                    help="a rank silent this long in a collective (or at the rendezvous) is lost")


def pool_config(args: argparse.Namespace) -> tuple[PoolConfig | None, bool]:
    """(this process's ``PoolConfig``, whether it starts the other ranks itself); (None, False) for a pool of one."""
    if args.world_size == 1 and args.rank in (None, 0):
        return None, False
    local = args.rank is None
    port = args.master_port or (free_port(args.master_addr) if local else 0)
    if not port:
        raise ValueError(f"trainer rank {args.rank}: --master-port (or MASTER_PORT) is required to join a pool "
                         f"of {args.world_size}")
    return PoolConfig(world_size=args.world_size, rank=args.rank or 0, master_addr=args.master_addr,
                      master_port=port, timeout_s=args.rank_timeout_s), local


def start_followers(pool: PoolConfig, argv: list[str]) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 on this machine with this process's flags (``argv``) and their place in the pool."""
    children = []
    for rank in range(1, pool.world_size):
        cmd = [sys.executable, "-m", "lathe.trainer", *argv, "--rank", str(rank), "--world-size",
               str(pool.world_size), "--master-addr", pool.master_addr, "--master-port", str(pool.master_port),
               "--port", "0", "--metrics-port", "-1"]  # local ranks share this host: health on any port
        # their stdout goes to our stderr: whoever started us reads our own "ready on" line from stdout
        children.append(subprocess.Popen(cmd, stdout=sys.stderr.fileno()))
        print(f"lathe.trainer rank {rank} pid {children[-1].pid}", flush=True)
    return children


def stop_followers(children: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Wait for local followers told to stop (bounded), then kill whatever is left."""
    for child in children:
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def exit_soon(children: list[subprocess.Popen]) -> Callable[[], None]:
    """The leader's ``on_rank_lost``: give the operations just answered ``EXIT_GRACE_S`` to reach their callers,
    then end this process and its local followers with ``EXIT_RANK_LOST`` (the pool re-forms on restart)."""
    def leave() -> None:
        for child in children:
            child.kill()
        os._exit(EXIT_RANK_LOST)

    def schedule() -> None:
        timer = threading.Timer(EXIT_GRACE_S, leave)
        timer.daemon = True
        timer.start()

    return schedule


def follower_config(cfg: TrainerConfig, rank: int) -> TrainerConfig:
    """A follower's engine settings: the leader's, with a page store of its own."""
    pages = Path(cfg.page_store) if cfg.page_store else cfg.cache_root / "paged"
    return replace(cfg, page_store=str(pages / f"rank{rank}"))


class Follower:
    """A follower's life on its own thread: form the pool, then apply the leader's plans until the leader says
    stop (``exit_code`` 0) or the pool breaks (``EXIT_RANK_LOST``, or a formation error's code). Meanwhile the
    process serves only gRPC health (and metrics): ``ready`` once it has joined the pool, ``alive`` until the
    loop ends, and the loop's end ends the process with ``exit_code`` (at once, even before the server is up)."""

    def __init__(self, cfg: TrainerConfig, catalog: ModelCatalog, pool: PoolConfig) -> None:
        self.cfg, self.catalog, self.pool = cfg, catalog, pool
        self.exit_code = 0
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lathe-rank{pool.rank}", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def ready(self) -> bool:
        return self._joined.is_set() and self._thread.is_alive()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        self.exit_code = self._follow()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)  # nothing to wind down: the health server dies with the process

    def _follow(self) -> int:
        try:
            group = join(self.pool, self.cfg.device, self.cfg.dtype)
        except PoolFormationError as e:
            log.error("%s", e)
            return e.exit_code
        engine = TrainerEngine(follower_config(self.cfg, self.pool.rank), self.catalog, None, group)
        self._joined.set()
        try:
            while (plan := group.broadcast(None)) is not None:
                engine.replay(plan)
        except RankLost as e:
            log.error("%s", e.message)
            return EXIT_RANK_LOST
        except Exception:  # noqa: BLE001 - this rank no longer matches the leader: the pool must re-form
            traceback.print_exc(file=sys.stderr)
            return EXIT_RANK_LOST
        return 0
