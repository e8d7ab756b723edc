"""Pool discovery: EndpointSlices parsed, listed and watched; the gateway routing to the pools found.

No Kubernetes API server can run on these machines, so ``StandInApi`` below is a stand-in, NOT a Kubernetes
API server: a loopback HTTP server implementing only what ``KubernetesDirectory`` calls, namely
``GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices`` (a list filtered by an equality
``labelSelector``, carrying a ``resourceVersion``) and its ``?watch=true`` variant (ADDED / MODIFIED / DELETED
events after the given ``resourceVersion``, newline-delimited JSON in chunks, until ``timeoutSeconds``). The
real ``kubernetes`` client is pointed at it. The routing test puts a real trainer and sampler of the tiny
model (the embedded stack's) behind the slices.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from lathe.errors import InvalidArgument
from lathe.gateway.core import GatewayCore
from lathe.gateway.discovery import DiscoveryConfig, Endpoint, Pool
from lathe.gateway.kube_discovery import KubernetesDirectory, parse_slice
from lathe.gateway.routing import pick
from lathe.runtime.internal_auth import TOKEN_ENV
from lathe.stack import Stack
from lathe.v1 import lathe_pb2 as pb

NS = "lathe-test"
SELECTOR = "app.kubernetes.io/name=lathe"
WAIT_S = 20.0
LORA = pb.LoraConfig(rank=4, train_attn=True, train_mlp=True)


def endpoint_slice(name: str, pool: str, role: str, addresses: list[str], port: int, *, ready: bool = True,
                   terminating: bool = False, labels: dict[str, str] | None = None) -> dict:
    """An EndpointSlice as the API server's JSON, labelled as the chart labels a pool's Service."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": NS, "labels": labels if labels is not None else {
            "app.kubernetes.io/name": "lathe", "lathe.dev/pool": pool, "lathe.dev/role": role,
            "kubernetes.io/service-name": f"lathe-{pool}-{role}"}},
        "ports": [{"name": "metrics", "port": 9400, "protocol": "TCP"}, {"name": "grpc", "port": port,
                                                                           "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready, "serving": ready, "terminating": terminating}}
                      for a in addresses],
    }


class StandInApi:
    """A stand-in for the Kubernetes API server (EndpointSlices only; see the module docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 1
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, dict]] = []  # (resourceVersion, event) in order
        self.closed = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # http.server's name
                url = urlparse(self.path)
                if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices":
                    self.send_error(404)
                    return
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                wanted = dict(term.split("=", 1) for term in q.get("labelSelector", "").split(",") if term)
                if q.get("watch") == "true":
                    api.stream(self, wanted, int(q.get("resourceVersion") or 0), float(q.get("timeoutSeconds", 30)))
                else:
                    api.respond_list(self, wanted)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    @staticmethod
    def matches(obj: dict, wanted: dict[str, str]) -> bool:
        labels = obj["metadata"].get("labels") or {}
        return all(labels.get(k) == v for k, v in wanted.items())

    def respond_list(self, h: BaseHTTPRequestHandler, wanted: dict[str, str]) -> None:
        with self.cond:
            items = [s for s in self.slices.values() if self.matches(s, wanted)]
            body = json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                               "metadata": {"resourceVersion": str(self.version)}, "items": items}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def stream(self, h: BaseHTTPRequestHandler, wanted: dict[str, str], since: int, timeout_s: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        deadline = time.monotonic() + timeout_s
        sent = since
        while True:
            with self.cond:
                self.cond.wait_for(functools.partial(self.newer, sent), timeout=max(0.0, deadline - time.monotonic()))
                fresh = [(v, e) for v, e in self.events if v > sent]
                done = self.closed or time.monotonic() >= deadline
            for v, event in fresh:
                sent = v
                if event["type"] == "ERROR" or self.matches(event["object"], wanted):
                    line = json.dumps(event).encode() + b"\n"
                    h.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    h.wfile.flush()
                if event["type"] == "ERROR":
                    done = True
            if done:
                h.wfile.write(b"0\r\n\r\n")
                h.close_connection = True
                return

    def newer(self, since: int) -> bool:
        """Whether the watch that has sent up to ``since`` has more to send (or the server is closing)."""
        return self.closed or bool(self.events) and self.events[-1][0] > since

    def apply(self, kind: str, obj: dict, *, silently: bool = False) -> None:
        """ADDED / MODIFIED / DELETED ``obj``; ``silently``: change the state without telling any watch."""
        with self.cond:
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.slices.pop(obj["metadata"]["name"], None)
            else:
                self.slices[obj["metadata"]["name"]] = obj
            if not silently:
                self.events.append((self.version, {"type": kind, "object": obj}))
            self.cond.notify_all()

    def expire(self) -> None:
        """End every watch with 410 Gone, as an API server does when a resourceVersion is too old."""
        with self.cond:
            self.version += 1
            self.events.append((self.version, {"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                "message": "too old resource version"}}))
            self.cond.notify_all()

    def __enter__(self) -> StandInApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[StandInApi]:
    with StandInApi() as a:
        yield a


def directory(api: StandInApi, **cfg: object) -> KubernetesDirectory:
    conf = client.Configuration(host=api.url)
    return KubernetesDirectory(DiscoveryConfig("kubernetes", namespace=NS, selector=SELECTOR, retry_s=0.1, **cfg),
                               client.ApiClient(conf))


def wait_for(what: str, ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---------- what a slice says ----------


def test_a_slice_lists_its_grpc_port_skips_terminating_endpoints_and_keeps_unready_ones_as_unready() -> None:
    obj = endpoint_slice("a", "llama", "trainer", ["10.0.0.2"], 8510)
    obj["endpoints"] += [{"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
                         {"addresses": ["10.0.0.4"], "conditions": {"ready": False, "terminating": True}},
                         {"addresses": ["fd00::5"]}]  # no conditions: ready (unknown is taken as ready)
    s = parse_slice(obj)
    assert s is not None and (s.pool, s.role) == ("llama", "trainer")
    assert s.endpoints == (Endpoint("10.0.0.2:8510"), Endpoint("10.0.0.3:8510", ready=False),
                           Endpoint("[fd00::5]:8510"))
    assert parse_slice(endpoint_slice("b", "llama", "trainer", ["10.0.0.2"], 1, labels={"app": "x"})) is None
    assert parse_slice(endpoint_slice("c", "llama", "gateway", ["10.0.0.2"], 1)) is None


def test_rendezvous_moves_only_the_keys_of_an_endpoint_that_left_and_prefers_ready_ones() -> None:
    three = [Endpoint(f"10.0.0.{i}:1") for i in range(3)]
    keys = [f"sess:train:{n}" for n in range(300)]
    before = {k: pick(three, k) for k in keys}
    assert len(set(before.values())) == 3  # spread over all three
    after = {k: pick(three[:2], k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == three[2].address for k in moved)
    unready = [Endpoint("10.0.0.9:1", ready=False), three[0]]
    assert {pick(unready, k) for k in keys} == {three[0].address}
    assert pick([Endpoint("10.0.0.9:1", ready=False)], "k") == "10.0.0.9:1"  # none ready: still somewhere


# ---------- the directory against the stand-in API server ----------


def test_the_directory_lists_then_follows_added_modified_and_deleted_slices(api: StandInApi) -> None:
    api.apply("ADDED", endpoint_slice("llama-trainer-x", "llama", "trainer", ["10.0.0.2"], 8510))
    api.apply("ADDED", endpoint_slice("other", "llama", "sampler", ["10.9.9.9"], 1, labels={"app": "other"}))
    d = directory(api)
    changes: list[int] = []
    d.subscribe(lambda: changes.append(1))
    d.start()
    try:
        assert d.pools() == {"llama": Pool("llama", (Endpoint("10.0.0.2:8510"),), ())}  # the list, before any watch
        assert not d.pools()["llama"].complete
        api.apply("ADDED", endpoint_slice("llama-sampler-x", "llama", "sampler", ["10.0.0.3", "10.0.0.4"], 8520))
        wait_for("the sampler slice", lambda: len(d.pools()["llama"].samplers) == 2)
        assert d.pools()["llama"].complete and changes
        api.apply("ADDED", endpoint_slice("qwen-trainer-x", "qwen", "trainer", ["10.0.1.2"], 8510))
        api.apply("MODIFIED", endpoint_slice("llama-sampler-x", "llama", "sampler", ["10.0.0.4"], 8520, ready=False))
        wait_for("the modified slice", lambda: d.pools()["llama"].samplers == (Endpoint("10.0.0.4:8520", False),))
        assert set(d.pools()) == {"llama", "qwen"}
        api.apply("DELETED", endpoint_slice("qwen-trainer-x", "qwen", "trainer", [], 8510))
        wait_for("the deleted slice", lambda: set(d.pools()) == {"llama"})
    finally:
        d.close()


def test_the_directory_lists_again_when_its_watch_expires(api: StandInApi) -> None:
    """A change the watch never told (it happened while the watch was gone) is found by the list after a 410."""
    d = directory(api)
    d.start()
    try:
        assert d.pools() == {}
        api.apply("ADDED", endpoint_slice("llama-trainer-x", "llama", "trainer", ["10.0.0.2"], 8510), silently=True)
        api.expire()
        wait_for("the relisted slice", lambda: "llama" in d.pools())
        api.apply("ADDED", endpoint_slice("llama-sampler-x", "llama", "sampler", ["10.0.0.3"], 8520))
        wait_for("the watch resumed after the list", lambda: d.pools()["llama"].complete)
    finally:
        d.close()


# ---------- the gateway routes to the pools found ----------


def test_the_gateway_serves_a_model_while_its_pool_is_present(api: StandInApi, stack: Stack,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices naming the stack's real trainer and sampler make ``lathe/tiny-llama`` appear in the capabilities
    and serve a run and a sample; deleting them makes the model disappear and its samples fail Unavailable."""
    monkeypatch.setenv(TOKEN_ENV, stack.internal_token)
    (t_host, t_port), (s_host, s_port) = (stack.service(n).address.rsplit(":", 1) for n in ("trainer", "sampler"))
    trainer = endpoint_slice("tiny-trainer-x", "tiny", "trainer", [t_host], int(t_port))
    sampler = endpoint_slice("tiny-sampler-x", "tiny", "sampler", [s_host], int(s_port))
    base = "lathe/tiny-llama"

    async def models(core: GatewayCore) -> list[str]:
        return [m.model_name for m in (await core.lookups.capabilities()).supported_models]

    async def until_models(core: GatewayCore, expected: list[str]) -> None:
        deadline = time.monotonic() + WAIT_S
        while await models(core) != expected:
            assert time.monotonic() < deadline, f"timed out waiting for the capabilities to list {expected}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        d = directory(api)
        await asyncio.to_thread(d.start)
        core = GatewayCore("", stack.service("checkpoints").address, "", pools=d)
        try:
            assert await models(core) == []
            session = core.book.create("t", {})
            with pytest.raises(InvalidArgument, match="unknown base_model"):
                await core.runs.create_model("t", pb.CreateModelRequest(session_id=session, base_model=base,
                                                                    lora_config=LORA))
            api.apply("ADDED", trainer)
            api.apply("ADDED", sampler)
            await until_models(core, stack.cfg.models.split(","))  # every model the stack's pools serve
            created = await core.runs.create_model("t", pb.CreateModelRequest(session_id=session, base_model=base,
                                                                         lora_config=LORA))
            done = await core.ledger.retrieve("t", created.request_id, WAIT_S)
            assert done.WhichOneof("result") == "create_model", done
            bound = await core.sampling.create_session("t", pb.CreateSamplingSessionRequest(session_id=session,
                                                                                            base_model=base))
            ask = pb.SampleRequest(sampling_session_id=bound.sampling_session_id, prompt=[1, 2, 3], num_samples=1,
                                   params=pb.SamplingParams(max_tokens=3, seed=1, temperature=1.0, top_p=1.0))
            sampled = await core.ledger.retrieve("t", (await core.sampling.sample("t", ask)).request_id, WAIT_S)
            assert sampled.WhichOneof("result") == "sample", sampled
            assert len(sampled.sample.sequences[0].tokens) == 3

            api.apply("DELETED", trainer)
            api.apply("DELETED", sampler)
            await until_models(core, [])
            failed = await core.ledger.retrieve("t", (await core.sampling.sample("t", ask)).request_id, WAIT_S)
            assert failed.error.code == "Unavailable" and "no pool serves base_model 'lathe/tiny-llama'" in \
                failed.error.message, failed
        finally:
            await core.close()
            await asyncio.to_thread(d.close)

    asyncio.run(scenario())
