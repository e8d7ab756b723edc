"""A trainer pool of N processes: the ``torch.distributed`` group its ranks talk over, and how it forms.

Rank 0 is the cycle leader (it serves gRPC and plans every cycle, ``lathe.trainer.engine``); ranks 1..N-1 are
followers (``lathe.trainer.ranks.Follower``). This module owns only the wire between them:

    join(PoolConfig, device) -> Group      rendezvous at MASTER_ADDR:MASTER_PORT (a TCPStore hosted by rank 0),
                                           world sizes checked, then one process group: gloo on CPU, NCCL on GPU
    Group.broadcast(obj)                   the leader's object (a cycle's plan) on every rank
    Group.gather(obj) -> [obj per rank]    every rank's object on every rank (a cycle's results)
    Group.all_gather(t) -> [t per rank]    one flat fp32 bucket per rank, every bucket on every rank (gradients)

Every collective runs under the pool's timeout (``PoolConfig.timeout_s``, given to ``init_process_group``).
Whatever goes wrong in one (a rank killed, a rank stalled past the timeout, a connection reset) comes out as
``RankLost``, a retryable ``Unavailable``: the leader answers its operations with it and the pool re-forms
(``EXIT_RANK_LOST``; see docs/distributed.md). Nothing here reads the environment: ``__main__`` builds the
``PoolConfig`` from flags whose defaults are RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lathe.errors import Unavailable

EXIT_RANK_LOST = 75  # a rank left the pool: every rank exits with this code and the pool is started again
EXIT_BAD_POOL = 2  # the ranks disagree on the pool's shape: restarting will not help


class RankLost(Unavailable):
    """A collective of the trainer pool failed or timed out: a rank died, stalled or left. Retryable: the pool
    re-forms and the gateway rebuilds its runs from their recovery snapshots."""


class PoolFormationError(RuntimeError):
    """The pool could not form: the leader is unreachable, or the ranks disagree on its shape. ``exit_code``
    says whether a restart may help (``EXIT_RANK_LOST``) or not (``EXIT_BAD_POOL``)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One rank's view of its pool (a Kubernetes StatefulSet sets RANK / WORLD_SIZE / MASTER_* per pod)."""

    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0  # rendezvous and every collective: a rank silent this long is lost

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a pool of world_size {self.world_size} (0..."
                             f"{self.world_size - 1})")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")

    @property
    def heartbeat_s(self) -> float:
        """How often an idle leader tells its followers it is alive (well inside their receive timeout)."""
        return min(5.0, self.timeout_s / 4)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (for a pool whose ranks this process starts itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Group:
    """The formed pool, as one rank sees it. ``seconds`` adds up the wall time spent in each kind of
    collective on this rank (the benchmark reads it)."""

    def __init__(self, cfg: PoolConfig, store: dist.Store, backend: str) -> None:
        self.cfg, self.backend, self._store = cfg, backend, store
        self.seconds: dict[str, float] = {"broadcast": 0.0, "gather": 0.0, "all_gather": 0.0}

    @property
    def rank(self) -> int:
        return self.cfg.rank

    @property
    def world(self) -> int:
        return self.cfg.world_size

    @property
    def leader(self) -> bool:
        return self.cfg.rank == 0

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        except Exception as e:  # every failure of a collective means the same: the pool is broken
            raise RankLost(f"trainer pool: {what} failed on rank {self.rank} of {self.world} (timeout "
                           f"{self.cfg.timeout_s:g} s): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                           "; the pool is re-forming, retry") from e
        finally:
            self.seconds[what] += time.monotonic() - t0

    def broadcast(self, obj: object) -> object:
        """The leader's ``obj`` on every rank (what followers pass is ignored)."""
        box = [obj]
        with self._guard("broadcast"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[object] = [None] * self.world
        with self._guard("gather"):
            dist.all_gather_object(out, obj)
        return out

    def all_gather(self, bucket: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``bucket`` (1-D, the same length and dtype on every rank), in rank order: one collective."""
        out = [torch.empty_like(bucket) for _ in range(self.world)]
        with self._guard("all_gather"):
            dist.all_gather(out, bucket)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join(cfg: PoolConfig, device: str, dtype: str) -> Group:
    """Form the pool: rank 0 hosts the rendezvous store at ``master_addr:master_port``, every rank checks that
    all agree on ``world_size`` and on the base weights' ``dtype`` (each rank resolves ``--dtype auto`` for its own
    device, and ranks of unlike dtypes would compute unlike bits), then the process group starts (gloo for
    ``cpu``, NCCL for ``cuda``). Raises ``PoolFormationError`` with what went wrong and where, within about
    ``timeout_s``."""
    where = f"{cfg.master_addr}:{cfg.master_port}"
    timeout = timedelta(seconds=cfg.timeout_s)
    try:
        store = dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=cfg.rank == 0, timeout=timeout,
                              wait_for_workers=False, use_libuv=False)
    except Exception as e:  # noqa: BLE001 - connect refused, timed out, address in use: all say where
        role = "host the pool's rendezvous at" if cfg.rank == 0 else "reach the pool's leader (rank 0) at"
        raise PoolFormationError(f"trainer rank {cfg.rank}: could not {role} {where} within {cfg.timeout_s:g} s: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                 EXIT_RANK_LOST) from None
    _check_shape(store, cfg, dtype, where)
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(cfg.rank % torch.cuda.device_count())
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=cfg.rank,
                                world_size=cfg.world_size, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - e.g. a rank that never came
        raise PoolFormationError(f"trainer rank {cfg.rank}: the {backend} process group at {where} did not form "
                                 f"within {cfg.timeout_s:g} s: {type(e).__name__}: {e}", EXIT_RANK_LOST) from None
    return Group(cfg, store, backend)


def _check_shape(store: dist.Store, cfg: PoolConfig, dtype: str, where: str) -> None:
    """Every rank writes the world size it was given and its dtype; rank 0 reads every follower's, each follower
    reads rank 0's. A disagreement, or a rank claimed twice, fails on both sides with the values."""
    if store.add(f"lathe/rank/{cfg.rank}", 1) > 1:
        raise PoolFormationError(f"trainer rank {cfg.rank}: another process already joined the pool at {where} "
                                 f"as rank {cfg.rank}", EXIT_BAD_POOL)
    store.set(f"lathe/world/{cfg.rank}", f"{cfg.world_size} {dtype}")
    peers = range(1, cfg.world_size) if cfg.rank == 0 else [0]
    for peer in peers:
        key = f"lathe/world/{peer}"
        try:
            store.wait([key])
            size, their_dtype = store.get(key).decode().split()
            theirs = int(size)
        except Exception:  # noqa: BLE001 - the store's own timeout, or its host gone: that rank is not there
            raise PoolFormationError(f"trainer rank {cfg.rank}: rank {peer} did not join the pool at {where} within "
                                     f"{cfg.timeout_s:g} s (world_size {cfg.world_size})", EXIT_RANK_LOST) from None
        if theirs != cfg.world_size:
            raise PoolFormationError(f"trainer rank {cfg.rank}: world size mismatch in the pool at {where}: rank "
                                     f"{peer} was started with world_size {theirs}, rank {cfg.rank} with "
                                     f"{cfg.world_size}", EXIT_BAD_POOL)
        if their_dtype != dtype:
            raise PoolFormationError(f"trainer rank {cfg.rank}: dtype mismatch in the pool at {where}: rank {peer} "
                                     f"holds its base weights in {their_dtype}, rank {cfg.rank} in {dtype}; give "
                                     "every rank the same --dtype (auto resolves on each rank's own device)",
                                     EXIT_BAD_POOL)
