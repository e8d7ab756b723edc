"""Pool discovery: where each pool's trainer and sampler endpoints are, and a signal when that changes.

Owns the ``PoolDirectory`` interface and its registry. A *pool* is one trainer (the gRPC endpoint of a
trainer pool: rank 0 of its StatefulSet in a cluster) and the samplers serving the same base models, under
one name. The directory says only where endpoints are; which base models a pool serves is asked of the pool
itself (``routing.PoolRouter``, through ``Capabilities``), so names with slashes never have to fit a label.

Two directories: ``StaticDirectory`` (one fixed pool, ``--trainer`` / ``--sampler``; the embedded stack and
any hand-wired deployment) and ``kube_discovery.KubernetesDirectory`` (labelled EndpointSlices, watched).
Directories may run their own thread; ``pools`` must be safe to call from any thread, and listeners are
called from the directory's thread with no arguments: they note the change and do their work later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

Listener = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str  # HOST:PORT of a gRPC server
    ready: bool = True  # not ready: starting or failing its probe (routed to only when none is ready)


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    trainers: tuple[Endpoint, ...] = ()
    samplers: tuple[Endpoint, ...] = ()

    @property
    def complete(self) -> bool:
        """Both halves present: a pool without its trainer or its samplers serves nothing."""
        return bool(self.trainers) and bool(self.samplers)

    @property
    def answering(self) -> bool:
        """A ready trainer and a ready sampler: worth asking for its capabilities."""
        return any(e.ready for e in self.trainers) and any(e.ready for e in self.samplers)


class PoolDirectory(Protocol):
    def pools(self) -> Mapping[str, Pool]:
        """The pools as last seen, by name (a snapshot; safe from any thread)."""
        ...

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener()`` after every change of ``pools()`` (from the directory's own thread)."""
        ...

    def start(self) -> None:
        """Begin watching (a no-op for a fixed directory); returns once the first listing is in, or failed."""
        ...

    def close(self) -> None:
        """Stop watching (bounded)."""
        ...


class Listeners:
    """The subscribers of one directory; directories hold one and call ``notify`` after each change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


class StaticDirectory:
    """One pool that never changes: ``trainer`` and ``sampler`` addresses given at start (always taken as ready,
    so a restarting service is waited for by the gateway's call retries, as before discovery existed)."""

    def __init__(self, trainer: str, sampler: str, name: str = "default") -> None:
        if not trainer or not sampler:
            raise ValueError(f"static discovery needs a trainer and a sampler address, got trainer={trainer!r} "
                             f"sampler={sampler!r}")
        self._pools = {name: Pool(name, (Endpoint(trainer),), (Endpoint(sampler),))}

    def pools(self) -> Mapping[str, Pool]:
        return self._pools

    def subscribe(self, listener: Listener) -> None:
        pass  # nothing ever changes

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """How the gateway finds its pools (``--discovery`` and the flags after it)."""

    kind: Literal["static", "kubernetes"] = "static"
    """how the trainer and sampler pools are found (a key of DIRECTORIES): static, the one pool at --trainer and
    --sampler; kubernetes, by their EndpointSlices"""
    trainer: str = ""
    """static discovery: address of the trainer pool"""
    sampler: str = ""
    """static discovery: address of the sampler pool"""
    namespace: str = ""
    """kubernetes discovery: the namespace of the pools' EndpointSlices ("": this pod's own)"""
    selector: str = "app.kubernetes.io/name=lathe"
    """kubernetes discovery: label selector of the pools' EndpointSlices"""
    watch_timeout_s: int = 60
    """kubernetes: one watch lasts at most this long, then the slices are listed anew"""
    request_timeout_s: float = 10.0
    """kubernetes: connect and list deadline"""
    retry_s: float = 1.0
    """kubernetes: pause after a failed list or watch"""

    def __post_init__(self) -> None:
        if self.kind not in DIRECTORIES:
            raise ValueError(f"discovery {self.kind!r} is not one of {sorted(DIRECTORIES)}")
        if self.watch_timeout_s < 1 or self.request_timeout_s <= 0 or self.retry_s <= 0:
            raise ValueError(f"discovery timeouts must be positive, got watch_timeout_s={self.watch_timeout_s} "
                             f"request_timeout_s={self.request_timeout_s} retry_s={self.retry_s}")


def _static(cfg: DiscoveryConfig) -> PoolDirectory:
    return StaticDirectory(cfg.trainer, cfg.sampler)


def _kubernetes(cfg: DiscoveryConfig) -> PoolDirectory:
    from .kube_discovery import KubernetesDirectory  # the kubernetes client: only where it is used

    return KubernetesDirectory(cfg)


DIRECTORIES: dict[str, Callable[[DiscoveryConfig], PoolDirectory]] = {
    "static": _static,
    "kubernetes": _kubernetes,
}


def make_directory(cfg: DiscoveryConfig) -> PoolDirectory:
    return DIRECTORIES[cfg.kind](cfg)
