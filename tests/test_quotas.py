"""Per-tenant quotas (issue 9, item 4; issue 22: adapter bytes, sessions): each quota refused through a real door
with the quota, the tenant's use and the limit in its message, leaving no state; another tenant untouched; resident
adapters paged out per tenant and back in bit for bit; checkpoint bytes freed by delete and by expiry; sessions and
sampling sessions freed by finishing a session. Also what a held-back tenant hears: the queue state of
its pending futures (``RetrieveFuture``) and a sampling client's ``on_queue_state_change``; and sampler handles,
which reach the same sampler for their own tenant only. The quota book and file on their own:
tests/test_quotas_book.py."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

import lathe
from lathe.channels import CHANNEL_OPTIONS
from lathe.errors import ResourceExhausted
from lathe.stack import Stack, StackConfig
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from lathe.v1 import tinker_public_pb2 as tp
from tests.quota_helpers import (
    BASE,
    RANK,
    _adapter_bytes,
    _client,
    _datum,
    _http,
    _logprobs,
    _refused,
    _runs,
    _sampler_checkpoint_bytes,
)

PROTO = "application/x-protobuf"
TENANTS = ("runs", "tokens", "busy", "meta", "pager", "roomy", "bytes", "free", "held", "adapters", "sessions",
           "inflate")


@pytest.fixture(scope="module")
def quota_stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("quotas")
    keys = root / "keys"
    keys.write_text("".join(f"tml-{t}={t}\n" for t in TENANTS))
    ckpt, adapter = _sampler_checkpoint_bytes(tiny_dir), _adapter_bytes(tiny_dir, RANK)
    quotas = root / "quotas.json"
    quotas.write_text(json.dumps({"default": {"max_runs": 8}, "tenants": {
        "adapters": {"max_adapter_bytes": 2 * adapter + adapter // 2},
        "sessions": {"max_sessions": 2, "max_sampling_sessions": 2},
        "runs": {"max_runs": 2}, "tokens": {"max_tokens_per_minute": 40}, "busy": {"max_inflight_ops": 2},
        "held": {"max_inflight_ops": 2}, "inflate": {"max_inflated_bytes": 1 << 16},
        "meta": {"max_user_metadata_bytes": 32}, "pager": {"max_resident_adapters": 1},
        "roomy": {"max_resident_adapters": 2}, "bytes": {"max_checkpoint_bytes": 2 * ckpt + ckpt // 2}}}))
    pages = root / "pages"
    cfg = StackConfig(models=BASE, store_root=root / "store", cache_root=model_cache, trainer_threads=1,
                      sampler_threads=1, api_keys_file=keys, quotas_file=quotas,
                      trainer_args=("--page-store", str(pages)))
    with Stack(cfg) as stack:
        yield stack, pages, ckpt


# ---------- through the doors ----------


def test_max_runs(quota_stack: tuple) -> None:
    stack = quota_stack[0]
    with _client(stack, "runs") as sc, _client(stack, "free") as other:
        for seed in (1, 2):
            sc.create_lora_training_client(BASE, rank=RANK, seed=seed)
        with pytest.raises(ResourceExhausted) as e:
            sc.create_lora_training_client(BASE, rank=RANK, seed=3)
        assert e.value.message == "quota max_runs: tenant has 2 training runs, the limit is 2"
        with _http(stack, "runs") as http:
            session = http.post("/create_session", json={"user_metadata": {}}).json()["session_id"]
            r = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                                 "lora_config": {"rank": RANK}})
        _refused(r, "quota max_runs: tenant has 2 training runs, the limit is 2", retry_after=False)
        assert _runs(sc) == 2  # the refusals registered nothing
        for seed in (1, 2, 3):  # another tenant is not counted against it
            other.create_lora_training_client(BASE, rank=RANK, seed=seed)
        assert _runs(other) == 3


def test_max_adapter_bytes_counts_what_each_run_allocates_fresh_or_from_a_state(quota_stack: tuple,
                                                                               tiny_dir: Path) -> None:
    stack = quota_stack[0]
    size = _adapter_bytes(tiny_dir, RANK)  # the trainer's own tensors, counted
    limit = 2 * size + size // 2
    want = (f"quota max_adapter_bytes: tenant's 2 training runs hold {2 * size} adapter bytes and the new one needs "
            f"{size} (weights and optimizer moments in fp32), the limit is {limit}")
    with _client(stack, "adapters") as sc:
        tc = sc.create_lora_training_client(BASE, rank=RANK, seed=1)
        sc.create_lora_training_client(BASE, rank=RANK, seed=2)
        with pytest.raises(ResourceExhausted) as e:
            sc.create_lora_training_client(BASE, rank=RANK, seed=3)
        assert e.value.message == want
        with _http(stack, "adapters") as http:
            session = http.post("/create_session", json={"user_metadata": {}}).json()["session_id"]
            r = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                                 "lora_config": {"rank": RANK}})
        _refused(r, re.escape(want), retry_after=False)
        state = tc.save_state("s").result().path
        with pytest.raises(ResourceExhausted) as e:  # a run from a saved state takes the state's rank
            sc.create_training_client_from_state(state)
        assert e.value.message == want
        sc.create_lora_training_client(BASE, rank=RANK // 2, seed=4)  # half a run's bytes were left: it fits
        attn = _adapter_bytes(tiny_dir, 1, train_mlp=False, train_unembed=False)  # only the trained targets count
        with pytest.raises(ResourceExhausted, match=re.escape(f"3 training runs hold {limit} adapter bytes and the "
                                                              f"new one needs {attn} ")):
            sc.create_lora_training_client(BASE, rank=1, train_mlp=False, train_unembed=False)
        assert _runs(sc) == 3  # the refusals registered nothing


def test_open_sessions_and_sampling_sessions_are_capped_until_a_session_finishes(quota_stack: tuple) -> None:
    stack = quota_stack[0]
    full_sessions = ("quota max_sessions: tenant has 2 open sessions, the limit is 2; finish the sessions it no "
                     "longer uses")
    full_samplers = ("quota max_sampling_sessions: tenant has 2 sampling sessions in its open sessions, the limit is "
                     "2; finish the sessions it no longer uses")
    with _http(stack, "sessions") as http:
        def session() -> httpx.Response:
            return http.post("/create_session", json={"user_metadata": {}})

        def sampler(session_id: str, n: int) -> httpx.Response:
            return http.post("/create_sampling_session", json={"session_id": session_id,
                                                               "sampling_session_seq_id": n, "base_model": BASE})

        first, second = (session().json()["session_id"] for _ in range(2))
        _refused(session(), re.escape(full_sessions), retry_after=False)
        made = [sampler(first, n).json()["sampling_session_id"] for n in (0, 1)]
        assert sampler(first, 1).json()["sampling_session_id"] == made[1]  # a repeat makes none: it passes
        _refused(sampler(second, 0), re.escape(full_samplers), retry_after=False)
        model_id = http.post("/create_model", json={"session_id": second, "model_seq_id": 0, "base_model": BASE,
                                                    "lora_config": {"rank": RANK}}).json()["model_id"]
        save = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0}  # makes a sampling session
        _refused(http.post("/save_weights_for_sampler", json=save), re.escape(full_samplers), retry_after=False)
        assert http.post(f"/sessions/{first}/finish", json={"reason": {"type": "success"}}).status_code == 200
        assert sampler(second, 0).status_code == 200  # the finished session's sampling sessions count no more
        third = session()
        assert third.status_code == 200, third.text
        _refused(session(), re.escape(full_sessions), retry_after=False)
        # a finished session's heartbeat answers 410, on which the official SDK stops beating
        gone = http.post("/session_heartbeat", json={"session_id": first})
        assert gone.status_code == 410 and gone.json()["error"] == f"session {first!r} has finished (success)"
        assert http.post("/session_heartbeat", json={"session_id": second}).status_code == 200


def test_tokens_per_minute_count_datums_prompts_and_sampled_tokens(quota_stack: tuple) -> None:
    stack = quota_stack[0]
    with _client(stack, "tokens") as sc, _client(stack, "free") as other:
        tc = sc.create_lora_training_client(BASE, rank=RANK, seed=1)
        tc.forward([_datum(30)]).result()
        with pytest.raises(ResourceExhausted) as e:
            tc.forward([_datum(30, seed=1)]).result()
        assert re.fullmatch(r"quota max_tokens_per_minute: tenant spent 30 tokens in the last 60 s and the request "
                            r"has 30, the limit is 40; retry in \d+\.\d s", e.value.message), e.value.message
        with pytest.raises(ResourceExhausted, match="the request has 41 tokens, more than the limit of 40 per minute"):
            sc.create_lora_training_client(BASE, rank=RANK, seed=2).forward([_datum(41)]).result()
        other.create_lora_training_client(BASE, rank=RANK, seed=1).forward([_datum(30)] * 3).result()

        with _http(stack, "tokens") as http:  # a sample spends its prompt and max_tokens at once and gets back
            # what it did not sample once it ends
            session = http.post("/create_session", json={"user_metadata": {}}).json()["session_id"]
            sid = http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                              "base_model": BASE}).json()["sampling_session_id"]
            sample = {"sampling_session_id": sid, "seq_id": 1, "num_samples": 1, "prompt": {"chunks": [
                {"tokens": list(range(5, 12))}]}, "sampling_params": {"max_tokens": 2, "temperature": 1.0}}
            rid = http.post("/asample", json=sample).json()["request_id"]
            while PROTO not in (res := http.post("/retrieve_future", json={"request_id": rid})).headers["content-type"]:
                assert res.json()["type"] == "try_again", res.text
            sampled = len(tp.SampleResponse.FromString(res.content).sequences[0].tokens) // 4  # int32s
            message = _refused(http.post("/asample", json=sample | {"seq_id": 2}),
                               r"quota max_tokens_per_minute: tenant spent \d+ tokens in the last 60 s and the "
                               r"request has 9, the limit is 40; retry in \d+\.\d s", retry_after=True)
        assert f"spent {30 + 7 + sampled} tokens" in message


def test_max_inflight_ops(quota_stack: tuple) -> None:
    stack = quota_stack[0]
    channel = grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS)
    stub, md = pb_grpc.GatewayStub(channel), (("x-api-key", "tml-busy"),)
    with _client(stack, "busy") as sc:
        model_id = sc.create_lora_training_client(BASE, rank=RANK).model_id

    def fb(seq: int) -> pb.SubmitResponse:
        req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy", forward_only=True,
                                        data=[lathe.wire.datum_to_proto(_datum(4))])
        return stub.ForwardBackward(req, metadata=md, timeout=60)

    fb(3), fb(2)  # both wait for seq_id 1: two requests in flight
    want = ("quota max_inflight_ops: tenant has 2 requests in flight, the limit is 2; retry in 1 s, once some have "
            "finished")
    for _ in range(2):  # refused twice alike: the first refusal took no place
        with pytest.raises(grpc.RpcError) as e:
            fb(4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details() == want
    with _http(stack, "busy") as http:
        r = http.post("/create_session", json={"user_metadata": {}})
        assert r.status_code == 200  # a session is no request in flight
        r = http.post("/create_model", json={"session_id": r.json()["session_id"], "model_seq_id": 0,
                                             "base_model": BASE, "lora_config": {"rank": RANK}})
    assert _refused(r, re.escape(want), retry_after=True) == want
    channel.close()
    with _client(stack, "free") as other:  # the other tenant's requests still go through
        other.create_lora_training_client(BASE, rank=RANK).forward([_datum(4)]).result()


def test_a_held_back_tenant_hears_its_queue_state(quota_stack: tuple, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """``RetrieveFuture`` of a pending request says whether the tenant's in-flight quota holds new work back, and a
    sampling client's hook hears the pause and its end; the default hook warns of a pause only."""
    stack = quota_stack[0]
    channel = grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS)
    stub, md = pb_grpc.GatewayStub(channel), (("x-api-key", "tml-held"),)
    monkeypatch.setattr(lathe.futures, "POLL_S", 0.02)  # the SDK's polls answer "not done" at once
    heard: list[tuple[lathe.QueueState, str | None]] = []
    with _client(stack, "held") as sc:
        model_id = sc.create_lora_training_client(BASE, rank=RANK).model_id
        sampler = sc.create_sampling_client(base_model=BASE)
        with caplog.at_level(logging.WARNING, logger="lathe"):
            sampler.on_queue_state_change(lathe.QueueState.ACTIVE, None)
            sampler.on_queue_state_change(lathe.QueueState.PAUSED_CAPACITY, None)
        # only Lathe's own records: an official SDK's heartbeat thread left by an earlier test may warn meanwhile
        assert [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "lathe"] == [
            f"Sampling is paused for sampler {sampler.sampling_session_id} (paused_capacity). Reason: unknown"]
        sampler.on_queue_state_change = lambda state, reason: heard.append((state, reason))  # type: ignore[method-assign]

        def fb(seq: int) -> str:
            req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy",
                                            forward_only=True, data=[lathe.wire.datum_to_proto(_datum(4))])
            return stub.ForwardBackward(req, metadata=md, timeout=60).request_id

        def state(request_id: str) -> tuple[bool, str, str]:
            res = stub.RetrieveFuture(pb.RetrieveFutureRequest(request_id=request_id, timeout_s=0), metadata=md,
                                      timeout=60)
            return res.done, res.queue_state, res.queue_state_reason

        waiting = fb(2)  # waits for seq_id 1: one of the tenant's two places
        assert state(waiting) == (False, "active", "")
        slow = sampler.sample(lathe.ModelInput.from_ints([5, 17, 42, 9]), 16,
                              lathe.SamplingParams(max_tokens=120, seed=3))  # the second place, while it runs
        assert len(slow.result(timeout=120).sequences) == 16
        assert heard == [(lathe.QueueState.PAUSED_RATE_LIMIT,
                          "quota max_inflight_ops: 2 requests in flight, the limit is 2"),
                         (lathe.QueueState.ACTIVE, None)]
        for rid in (fb(1), waiting):  # seq_id 1 lets the run go on
            done = stub.RetrieveFuture(pb.RetrieveFutureRequest(request_id=rid, timeout_s=30), metadata=md,
                                       timeout=60)
            assert done.done and done.HasField("forward_backward") and not done.queue_state
        held = fb(4)  # both wait for seq_id 3: the tenant's two places, so the quota holds new work back
        fb(5)
        assert state(held) == (False, "paused_rate_limit", "quota max_inflight_ops: 2 requests in flight, the limit "
                                                           "is 2")
    channel.close()


def test_a_sampler_handle_reaches_the_same_sampler_for_its_tenant_only(quota_stack: tuple) -> None:
    stack = quota_stack[0]
    prompt = lathe.ModelInput.from_ints([5, 17, 42, 9])
    seeded = lathe.SamplingParams(max_tokens=12, seed=7, temperature=1.0)

    def bits(res: lathe.SampleResponse) -> list[tuple[list[int], list[float]]]:
        return [(list(s.tokens), list(s.logprobs or [])) for s in res.sequences]

    with _client(stack, "free") as sc:
        tc = sc.create_lora_training_client(BASE, rank=RANK)
        tc.forward_backward([_datum(6)], "cross_entropy").result()
        tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
        original = tc.save_weights_and_get_sampling_client()
        want = bits(original.sample(prompt, 2, seeded).result())  # the original's seq_id 1
        handle = original.get_sampler_handle()
        rebuilt = lathe.SamplingClient.from_sampler_handle(handle, api_key="tml-free", base_url=stack.gateway)
        try:
            assert (rebuilt.sampling_session_id, rebuilt.model_path, rebuilt.base_model) == (
                original.sampling_session_id, original.model_path, BASE)
            # its first request is its own (a seq_id space of its own), not the original's first answered again
            other = bits(rebuilt.sample(prompt, 2, lathe.SamplingParams(max_tokens=12, seed=8)).result())
            assert other != want
            assert bits(rebuilt.sample(prompt, 2, seeded).result()) == want
        finally:
            rebuilt.close()
    with pytest.raises(lathe.NotFound, match=re.escape(f"unknown sampling_session_id {handle!r}")):
        lathe.SamplingClient.from_sampler_handle(handle, api_key="tml-held", base_url=stack.gateway)


def test_user_metadata_bytes(quota_stack: tuple) -> None:
    stack = quota_stack[0]
    big = {"note": "x" * 29}  # 4 + 29 = 33 bytes
    want = "quota max_user_metadata_bytes: user_metadata has 33 bytes (1 entries), the limit is 32"
    with _client(stack, "meta", user_metadata=big) as sc, pytest.raises(ResourceExhausted, match=re.escape(want)):
        sc.create_lora_training_client(BASE, rank=RANK)
    with _client(stack, "meta") as sc:
        with pytest.raises(ResourceExhausted, match=re.escape(want)):
            sc.create_lora_training_client(BASE, rank=RANK, user_metadata=big)
        assert _runs(sc) == 0
        tc = sc.create_lora_training_client(BASE, rank=RANK, user_metadata={"note": "x" * 28})  # 32: fits
        with pytest.raises(ResourceExhausted, match=re.escape(want)):
            tc.save_state("s", user_metadata=big).result()
        assert sc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints == []
    with _http(stack, "meta") as http:
        _refused(http.post("/create_session", json={"user_metadata": big}), re.escape(want), retry_after=False)
    with _client(stack, "free", user_metadata=big) as other:
        other.create_lora_training_client(BASE, rank=RANK, user_metadata=big)


def test_a_zstd_body_inflates_no_further_than_the_tenants_own_quota(quota_stack: tuple) -> None:
    """The tenant's ``max_inflated_bytes`` (64 KiB here) bounds what its zstd bodies decompress to, below the
    gateway's own 16 MiB: 100 KB of valid JSON in a few hundred bytes is refused with 413 naming the quota, and the
    same bytes open a session for another tenant."""
    import zstandard

    stack = quota_stack[0]
    body = zstandard.ZstdCompressor().compress(b'{"tags": []}' + b" " * 100_000)
    headers = {"content-type": "application/json", "content-encoding": "zstd"}
    with _http(stack, "inflate") as http:
        r = http.post("/create_session", content=body, headers=headers)
    assert r.status_code == 413 and r.headers["x-should-retry"] == "false", r.text
    assert r.json()["error"] == (f"the zstd request body ({len(body)} bytes) decompresses to over the limit of "
                                 f"{1 << 16} bytes (the tenant's max_inflated_bytes quota)")
    with _http(stack, "free") as http:
        r = http.post("/create_session", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["session_id"], r.text


def _paged(pages: Path, model_id: str) -> bool:
    """Whether the trainer holds ``model_id``'s adapter paged out in the page store (``bank._page_prefix``)."""
    d = pages / "paged" / hashlib.sha256(model_id.encode()).hexdigest()[:32]
    return d.is_dir() and any(d.iterdir())


def test_resident_adapters_page_out_per_tenant_and_back_in_bit_for_bit(quota_stack: tuple) -> None:
    stack, pages, _ = quota_stack
    data = [_datum(12, seed=s) for s in range(3)]
    with _client(stack, "pager") as sc, _client(stack, "roomy") as other:
        a = sc.create_lora_training_client(BASE, rank=RANK, seed=1)
        for _ in range(2):  # move the weights off their initial values
            a.forward_backward(data, "cross_entropy")
            a.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
        before = _logprobs(a.forward(data).result())
        assert not _paged(pages, a.model_id)
        mine = [other.create_lora_training_client(BASE, rank=RANK, seed=s) for s in (1, 2)]
        b = sc.create_lora_training_client(BASE, rank=RANK, seed=2)  # over its quota of 1: its own oldest goes
        assert _paged(pages, a.model_id) and not _paged(pages, b.model_id)
        assert not any(_paged(pages, tc.model_id) for tc in mine)  # within its quota of 2: nothing paged
        after = _logprobs(a.forward(data).result())  # paged back in ...
        assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))  # ... bit for bit
        a.forward(data[:1]).result()  # a later cycle: the one before has paged out what it had to
        assert not _paged(pages, a.model_id) and _paged(pages, b.model_id)
        assert not any(_paged(pages, tc.model_id) for tc in mine)


def test_checkpoint_bytes_are_freed_by_delete_and_by_expiry(quota_stack: tuple) -> None:
    stack, _, size = quota_stack
    limit = 2 * size + size // 2
    with _client(stack, "bytes") as sc:
        tc = sc.create_lora_training_client(BASE, rank=RANK)
        rest = sc.create_rest_client()
        first = tc.save_weights_for_sampler("a", ttl_seconds=2).result().path
        expires = time.monotonic() + 2
        second = tc.save_weights_for_sampler("b").result().path
        assert [c.size_bytes for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [size, size]
        with pytest.raises(ResourceExhausted) as e:
            tc.save_weights_for_sampler("c").result()
        assert e.value.message == (f"quota max_checkpoint_bytes: tenant has {2 * size} bytes in live checkpoints and "
                                   f"saving tinker://{tc.model_id}/sampler_weights/c would add {size}, the limit is "
                                   f"{limit}; delete checkpoints to make room")
        paths = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert paths == [first, second]  # the refused save left nothing
        time.sleep(max(0.0, expires - time.monotonic()) + 0.5)
        third = tc.save_weights_for_sampler("c").result().path  # the expired one no longer counts
        with pytest.raises(ResourceExhausted, match=f"tenant has {2 * size} bytes in live checkpoints"):
            tc.save_weights_for_sampler("d").result()
        rest.delete_checkpoint_from_tinker_path(second).result()
        fourth = tc.save_weights_for_sampler("d").result().path  # the deleted one freed its room
        assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [third, fourth]
