"""The Tinker HTTP door's session, completion-queue, cancel and compressed-body routes, called as the official
``tinker`` SDK calls them (its own resource methods and request types) against real processes."""

from __future__ import annotations

import asyncio
import pickle

import httpx
import pytest
import tinker
import zstandard
from tinker import types
from tinker._client import AsyncTinker
from tinker.proto import request_conv, response_conv
from tinker.types.futures_retrieve_request import FuturesRetrieveRequest, SamplingSessionFuturesTarget
from tinker.types.join_sampling_session_request import JoinSamplingSessionRequest

from lathe.stack import Stack
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]
PROTO = "application/x-protobuf"
WAIT_S = 60.0


def _http(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": key}, timeout=WAIT_S)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _result(http: httpx.Client, request_id: str) -> httpx.Response:
    while True:
        r = http.post("/retrieve_future", json={"request_id": request_id})
        if PROTO in r.headers["content-type"] or r.json().get("type") != "try_again":
            return r


def _sampler(http: httpx.Client) -> tuple[str, str]:
    session = _ok(http.post("/create_session", json={"user_metadata": {}}))["session_id"]
    sid = _ok(http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                         "base_model": BASE}))["sampling_session_id"]
    return session, sid


def _sample(http: httpx.Client, sid: str, seq_id: int, max_tokens: int = 4, num_samples: int = 1) -> str:
    return _ok(http.post("/asample", json={
        "sampling_session_id": sid, "seq_id": seq_id, "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": 3, "stop": []}}))["request_id"]


def test_the_sdk_samples_through_its_completion_poller_and_joined_clones(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-poller")
    sampler = sc.create_sampling_client(base_model=BASE).result()
    first = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=4, seed=3))
    clone = pickle.loads(pickle.dumps(sampler))  # asks /join_sampling_session for its client number
    again = clone.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=4, seed=3))
    assert first.result().sequences[0].tokens == again.result().sequences[0].tokens  # same seed, same tokens


def _event(c: object) -> tuple[str, str]:
    """A completion as the SDK's response holds it (its union type is left as a plain dict)."""
    d = c if isinstance(c, dict) else c.model_dump()
    return d["state"], d["request_id"]


def test_retrieve_futures_reports_each_finished_sample_once_per_client(stack: Stack) -> None:
    with _http(stack, "tml-queue") as http:
        _, sid = _sampler(http)
        clone_seq = 1_000_000_000  # client 1's first seq_id
        mine, theirs = [_sample(http, sid, 1), _sample(http, sid, 2)], _sample(http, sid, clone_seq + 1)
        for rid in (*mine, theirs):
            assert PROTO in _result(http, rid).headers["content-type"]

    async def poll() -> tuple:
        async with AsyncTinker(base_url=stack.http_url, api_key="tml-queue") as client:
            target = SamplingSessionFuturesTarget(sampling_session_id=sid)
            got = await client.futures.retrieve_multi(request=FuturesRetrieveRequest(target=target))
            seen = await client.futures.retrieve_multi(request=FuturesRetrieveRequest(
                target=target, prev_cursor=got.cursor, timeout=0))
            other = await client.futures.retrieve_multi(request=FuturesRetrieveRequest(
                target=SamplingSessionFuturesTarget(sampling_session_id=sid, cloned_sampler_id=1), timeout=0))
            joined = [await client.service.join_sampling_session(
                request=JoinSamplingSessionRequest(sampling_session_id=sid)) for _ in range(2)]
            return got, seen, other, joined

    got, seen, other, joined = asyncio.run(poll())
    assert [_event(c) for c in got.completions] == [("finished", rid) for rid in mine]
    assert (seen.completions, seen.cursor) == ([], got.cursor)  # seen once: passing the cursor drops them
    assert [_event(c) for c in other.completions] == [("finished", theirs)]
    assert [j.client_counter for j in joined] == [1, 2]  # the original client is 0


def test_cancel_future_stops_a_pending_sample_and_keeps_finished_results(stack: Stack) -> None:
    with _http(stack, "tml-cancel") as http, _http(stack, "tml-other") as other:
        _, sid = _sampler(http)
        slow = _sample(http, sid, 1, max_tokens=120, num_samples=16)
        assert other.post("/cancel_future", json={"request_id": slow}).status_code == 404  # not theirs
        assert _ok(http.post("/cancel_future", json={"request_id": slow})) == {"request_id": slow, "cancelled": True}
        body = _ok(_result(http, slow))
        assert body["category"] == "user" and "cancelled by the client" in body["error"]
        events = _ok(http.post("/retrieve_futures", json={"target": {"sampling_session_id": sid}, "timeout": 0}))
        assert [(c["state"], c["request_id"]) for c in events["completions"]] == [("failed", slow)]

        done = _sample(http, sid, 2)
        kept = _result(http, done).content
        assert _ok(http.post("/cancel_future", json={"request_id": done})) == {"request_id": done,
                                                                                 "cancelled": False}
        assert _result(http, done).content == kept


def _model(http: httpx.Client) -> tuple[str, str]:
    session = _ok(http.post("/create_session", json={"user_metadata": {"k": "v"}}))["session_id"]
    fut = _ok(http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                               "lora_config": {"rank": 4, "seed": 1}}))
    _ok(_result(http, fut["request_id"]))
    return session, fut["model_id"]


def test_sessions_list_newest_first_with_their_runs_and_samplers(stack: Stack) -> None:
    with _http(stack, "tml-lister") as http:
        older, model = _model(http)
        _ok(http.post("/create_sampling_session", json={"session_id": older, "sampling_session_seq_id": 0,
                                                        "base_model": BASE}))
        newer = _ok(http.post("/create_session", json={"user_metadata": {}}))["session_id"]
        waiting = _ok(http.post("/optim_step", json={"model_id": model, "seq_id": 2, "adam_params": {}}))  # for 1
        r = http.post("/cancel_future", json={"request_id": waiting["request_id"]})
        assert r.status_code == 400 and "only samples can be cancelled" in r.json()["error"], r.text

    rc = tinker.RestClient(base_url=stack.http_url, api_key="tml-lister")
    assert rc.list_sessions().result().sessions == [newer, older]
    assert rc.list_sessions(limit=1, offset=1).result().sessions == [older]
    got = rc.get_session(older).result()
    assert (got.training_run_ids, got.sampler_ids, got.user_metadata) == ([model], [f"{older}:sample:0"], {"k": "v"})
    stranger = tinker.RestClient(base_url=stack.http_url, api_key="tml-stranger")
    assert older not in stranger.list_sessions().result().sessions
    with pytest.raises(tinker.NotFoundError):
        stranger.get_session(older).result()


def test_a_zstd_body_reads_as_the_plain_one_and_a_bomb_is_refused(stack: Stack) -> None:
    with _http(stack, "tml-zstd") as http:
        _, model = _model(http)
        toks = [5, 17, 42, 9, 33, 120, 7, 88, 64]
        datum = next_token_datum(toks, types)

        def body(seq_id: int) -> bytes:
            msg = request_conv.forward_backward_request_to_proto(types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
                model_id=model, seq_id=seq_id))
            msg.forward_only = True
            return msg.SerializeToString()

        plain = _ok(http.post("/forward_backward", content=body(1), headers={"content-type": PROTO}))
        packed = _ok(http.post("/forward_backward", content=zstandard.ZstdCompressor().compress(body(2)),
                               headers={"content-type": PROTO, "content-encoding": "zstd"}))
        out = [response_conv.deserialize_forward_backward_output(_result(http, f["request_id"]).content)
               for f in (plain, packed)]
        assert out[0].loss_fn_outputs[0]["logprobs"].tolist() == out[1].loss_fn_outputs[0]["logprobs"].tolist()

        cap = _ok(http.get("/get_server_capabilities"))["limits"]["max_message_bytes"]
        bomb = zstandard.ZstdCompressor().compress(bytes(cap + 1))
        assert len(bomb) < cap // 100
        r = http.post("/forward_backward", content=bomb, headers={"content-type": PROTO, "content-encoding": "zstd"})
        assert r.status_code == 413 and "decompresses to over the limit" in r.json()["error"], r.text
        r = http.post("/forward_backward", content=b"not zstd", headers={"content-type": PROTO,
                                                                        "content-encoding": "zstd"})
        assert r.status_code == 400 and "does not decompress" in r.json()["error"], r.text
