"""Pool discovery in a Kubernetes cluster: the chart's labelled EndpointSlices, listed and then watched.

The chart gives each pool's trainer and sampler Services the labels ``lathe.dev/pool: <pool>`` and
``lathe.dev/role: trainer|sampler``; Kubernetes copies a Service's labels onto its EndpointSlices, so the
slices of every pool match one label selector. ``KubernetesDirectory`` owns the slices it has seen
(slice name -> its role, pool and endpoints) and derives ``pools()`` from them; it never talks gRPC.

One thread runs list, then watch from the list's ``resourceVersion`` (ADDED / MODIFIED / DELETED events,
each replacing or removing one slice), and lists again whenever a watch ends: after ``watch_timeout_s``, on an
error event (e.g. 410 Gone) or a broken connection (after ``retry_s``). Every request has a deadline, so
``close`` is bounded. An endpoint marked terminating is left out; one not ready yet is kept as not ready.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines
from urllib3 import HTTPResponse

from .discovery import DiscoveryConfig, Endpoint, Listener, Listeners, Pool

log = logging.getLogger("lathe.gateway")

POOL_LABEL = "lathe.dev/pool"
ROLE_LABEL = "lathe.dev/role"
PORT_NAME = "grpc"  # the chart's name for each Service's gRPC port


@dataclass(frozen=True, slots=True)
class Slice:
    pool: str
    role: str  # "trainer" or "sampler"
    endpoints: tuple[Endpoint, ...]


def parse_slice(obj: Mapping[str, Any]) -> Slice | None:
    """One EndpointSlice (as the API's JSON) as a ``Slice``; None when it is not a Lathe pool's."""
    labels = obj.get("metadata", {}).get("labels") or {}
    pool, role = labels.get(POOL_LABEL), labels.get(ROLE_LABEL)
    if not pool or role not in ("trainer", "sampler"):
        return None
    ports = obj.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == PORT_NAME), None)
    if port is None and ports:
        port = ports[0].get("port")
    if port is None:
        return Slice(pool, role, ())
    found = []
    for ep in obj.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        if cond.get("terminating"):
            continue
        for ip in ep.get("addresses") or []:
            host = f"[{ip}]" if ":" in ip else ip
            found.append(Endpoint(f"{host}:{port}", ready=cond.get("ready") is not False))  # unknown: ready
    return Slice(pool, role, tuple(sorted(found, key=lambda e: e.address)))


class KubernetesDirectory:
    """``PoolDirectory`` over the EndpointSlices of ``cfg.namespace`` matching ``cfg.selector``.

    ``api``: a configured ``kubernetes.client.ApiClient`` (default: the pod's in-cluster service account)."""

    def __init__(self, cfg: DiscoveryConfig, api: client.ApiClient | None = None) -> None:
        if not cfg.namespace:
            raise ValueError("kubernetes discovery needs the namespace of the pools (--discovery-namespace)")
        self.cfg = cfg
        if api is None:
            config.load_incluster_config()
            api = client.ApiClient()
        self._api = client.DiscoveryV1Api(api)
        self._lock = threading.Lock()
        self._slices: dict[str, Slice] = {}
        self._pools: dict[str, Pool] = {}
        self._listeners = Listeners()
        self._stop = threading.Event()
        self._resp: HTTPResponse | None = None  # the watch in progress (``close`` shuts it)
        self._thread: threading.Thread | None = None

    # ---- PoolDirectory ----

    def pools(self) -> Mapping[str, Pool]:
        with self._lock:
            return dict(self._pools)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.add(listener)

    def start(self) -> None:
        """List once (so the gateway starts knowing its pools, unless the API server is unreachable: then the
        thread keeps trying), then watch in a daemon thread."""
        version = self._try_list()
        self._thread = threading.Thread(target=self._run, args=(version,), name="lathe-discovery", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._resp is not None:
            self._resp.shutdown()  # wakes the thread blocked reading the watch
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.request_timeout_s)

    # ---- list and watch ----

    def _run(self, version: str | None) -> None:
        while not self._stop.is_set():
            if version is None:
                version = self._try_list()
                if version is None:
                    self._stop.wait(self.cfg.retry_s)
                    continue
            try:
                self._follow(version)
            except Exception as e:  # noqa: BLE001 - any failure of the watch: list again, after a pause
                self._say(f"watching EndpointSlices failed ({type(e).__name__}: {e}); listing again")
                self._stop.wait(self.cfg.retry_s)
            version = None

    def _try_list(self) -> str | None:
        """Replace every slice with the API server's list; its resourceVersion, or None when the list failed."""
        try:
            resp = self._api.list_namespaced_endpoint_slice(
                self.cfg.namespace, label_selector=self.cfg.selector, _preload_content=False,
                _request_timeout=self.cfg.request_timeout_s)
            doc = json.loads(resp.data)
        except Exception as e:  # noqa: BLE001 - unreachable or refusing: the caller tries again later
            self._say(f"listing EndpointSlices in {self.cfg.namespace!r} failed: {type(e).__name__}: {e}")
            return None
        slices = {}
        for item in doc.get("items") or []:
            parsed = parse_slice(item)
            if parsed is not None:
                slices[item["metadata"]["name"]] = parsed
        self._set(slices)
        return doc.get("metadata", {}).get("resourceVersion") or ""

    def _follow(self, version: str) -> None:
        """Apply watch events from ``version`` until the watch ends (its timeout, or ``close``); an error event
        (410 Gone: ``version`` is too old) raises, so the caller lists again."""
        resp = self._api.list_namespaced_endpoint_slice(
            self.cfg.namespace, label_selector=self.cfg.selector, resource_version=version, watch=True,
            timeout_seconds=self.cfg.watch_timeout_s, _preload_content=False,
            _request_timeout=(self.cfg.request_timeout_s, self.cfg.watch_timeout_s + self.cfg.request_timeout_s))
        self._resp = resp
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return
                event = json.loads(line)
                obj, kind = event.get("object") or {}, event.get("type")
                if kind == "ERROR":
                    raise RuntimeError(f"the watch ended with {obj.get('code')} {obj.get('reason')}: "
                                       f"{obj.get('message')}")
                slices = self._snapshot()
                parsed = parse_slice(obj) if kind in ("ADDED", "MODIFIED") else None
                if parsed is None:
                    slices.pop(obj.get("metadata", {}).get("name", ""), None)
                else:
                    slices[obj["metadata"]["name"]] = parsed
                self._set(slices)
        finally:
            resp.release_conn()

    def _snapshot(self) -> dict[str, Slice]:
        with self._lock:
            return dict(self._slices)

    def _set(self, slices: dict[str, Slice]) -> None:
        """Take ``slices`` as the state; listeners hear of it when the pools they make changed."""
        merged: dict[str, dict[str, list[Endpoint]]] = {}
        for s in slices.values():
            merged.setdefault(s.pool, {"trainer": [], "sampler": []})[s.role].extend(s.endpoints)
        pools = {name: Pool(name, tuple(sorted(set(r["trainer"]), key=lambda e: e.address)),
                            tuple(sorted(set(r["sampler"]), key=lambda e: e.address)))
                 for name, r in sorted(merged.items())}
        with self._lock:
            self._slices = slices
            changed, self._pools = pools != self._pools, pools
        if changed:
            self._say(f"pools now {self._describe(pools)}")
            self._listeners.notify()

    @staticmethod
    def _describe(pools: Mapping[str, Pool]) -> str:
        return ", ".join(f"{p.name} (trainers {len(p.trainers)}, samplers {len(p.samplers)})"
                         for p in pools.values()) or "none"

    @staticmethod
    def _say(line: str) -> None:
        log.info("discovery: %s", line)
