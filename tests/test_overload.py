"""A full trainer queue, met at the Tinker HTTP door: an operation already accepted waits for a place (its future
says ``queue_state: paused_capacity``) instead of failing, a new one is refused with 429 + ``Retry-After`` before
anything is recorded, and the official SDK, retrying on its own, gets its operation done once the queue drains.

The trainer here keeps one waiting operation per tenant (``--max-queue-per-tenant 1``). The queue is filled on
purpose and deterministically: an operation sent ahead of its predecessor waits in the trainer's sequencer for it,
and holds the tenant's one place until the predecessor (let in as the operation its run waits for) arrives."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types
from tinker.proto import request_conv

from lathe.stack import Stack, StackConfig
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
PROTO = "application/x-protobuf"
KEY = "tml-overload"
TOKENS = [5, 17, 42, 9, 33, 120, 7, 88, 64]
HOLD_S = 3.0  # how long the SDK's operation is held off before the queue drains


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Stack]:
    cfg = StackConfig(models=BASE, store_root=tmp_path_factory.mktemp("store"), cache_root=model_cache,
                      trainer_threads=1, sampler_threads=1, metrics=True,
                      trainer_args=("--max-queue-per-tenant", "1"))
    with Stack(cfg) as s:
        yield s


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _datum() -> types.Datum:
    return next_token_datum(TOKENS, types)


class RawRun:
    """A training run driven by hand over HTTP, so its operations can be sent out of order."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        session = _ok(http.post("/create_session", json={"user_metadata": {}}))["session_id"]
        fut = _ok(http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                                   "lora_config": {"rank": 4, "seed": 1}}))
        self.model_id = fut["model_id"]
        self.result(fut["request_id"])

    def forward(self, seq_id: int) -> httpx.Response:
        msg = request_conv.forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[_datum()], loss_fn="cross_entropy"),
            model_id=self.model_id, seq_id=seq_id))
        return self.http.post("/forward_backward", content=msg.SerializeToString(),
                              headers={"content-type": PROTO})

    def poll(self, request_id: str, hold_s: int = 1) -> httpx.Response:
        """One long-poll of ``request_id``, held at most about ``hold_s`` (the door keeps 15 s of the client's
        read timeout in hand)."""
        return self.http.post("/retrieve_future", json={"request_id": request_id},
                              headers={"x-stainless-read-timeout": str(15 + hold_s)})

    def result(self, request_id: str) -> httpx.Response:
        while True:
            r = self.poll(request_id, 30)
            if PROTO in r.headers["content-type"] or r.json().get("type") != "try_again":
                return r


def _count_429(stack: Stack, route: str) -> float:
    text = httpx.get(stack.metrics_urls["gateway"], timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "lathe_gateway_http_requests_total" and s.labels == {"route": route, "status": "429"})


def test_a_full_queue_parks_the_accepted_and_refuses_the_new_until_it_drains(stack: Stack) -> None:
    with httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http:
        run = RawRun(http)
        second = _ok(run.forward(2))  # waits in the trainer for seq_id 1: the tenant's one place is taken
        third = _ok(run.forward(3))  # accepted and recorded; the trainer's queue is full for it
        held = run.poll(third["request_id"]).json()
        assert held["type"] == "try_again" and held["queue_state"] == "paused_capacity", held
        refused = run.forward(4)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert "trainer queue" in refused.json()["error"] and "x-should-retry" not in refused.headers
        first = _ok(run.forward(1))  # the operation the run waits for is let in, and drains the queue
        for fut in (first, second, third):
            assert PROTO in run.result(fut["request_id"]).headers["content-type"]
        fourth = _ok(run.forward(4))  # the refused request left nothing behind: its retry runs as new
        assert PROTO in run.result(fourth["request_id"]).headers["content-type"]


def test_the_official_sdk_retries_a_429_and_its_operation_runs_once_the_queue_drains(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key=KEY)
    tc = sc.create_lora_training_client(BASE, rank=4).result()
    with httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http:
        blocker = RawRun(http)
        waiting = _ok(blocker.forward(2))
        parked = _ok(blocker.forward(3))  # the tenant's queue is now full: its next operations are refused
        refused_before = _count_429(stack, "forward_backward")
        drain = threading.Timer(HOLD_S, lambda: blocker.forward(1))
        started = time.monotonic()
        drain.start()
        try:
            out = tc.forward_backward([_datum()], "cross_entropy").result()
        finally:
            drain.join()
        assert time.monotonic() - started >= HOLD_S  # it ran only once the queue drained
        assert out.metrics["loss:sum"] > 0 and len(out.loss_fn_outputs) == 1
        assert _count_429(stack, "forward_backward") > refused_before  # the SDK saw 429 and retried
        for fut in (waiting, parked):
            assert PROTO in blocker.result(fut["request_id"]).headers["content-type"]
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()  # the run goes on in order
    sc.close("success").result()
