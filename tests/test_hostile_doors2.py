"""Hostile tenants, second round (issue 22), through both real doors of a running stack: requests that would cost
the gateway memory before any check are refused before the work (a stranger's gRPC message is never read, a zstd
bomb is refused as it inflates, a body of too many values before they become lists); a non-finite optimizer
parameter that the official SDK writes as ``null`` is refused by name; an ordered operation refused while its body
is decoded does not hold up the run's next ones; and a run's recovery snapshot cannot be copied, re-TTLed,
published or deleted by its tenant."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tinker
import zstandard
from grpc_health.v1 import health_pb2, health_pb2_grpc

import lathe
from lathe.channels import CHANNEL_OPTIONS
from lathe.errors import ResourceExhausted
from lathe.gateway.auth import ApiKeys
from lathe.gateway.limits import DecodeGate, HttpLimits
from lathe.gateway.server import GateDecodes, RequireApiKey
from lathe.stack import Stack
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from lathe.v1 import tinker_public_pb2 as tp
from tests.conftest import tiny_stack
from tests.helpers import pb_datum
from tests.test_hostile_doors import ADAM, BASE, MIB, PROTO, TOKENS, WAIT_S, Grpc, Http, _peak_rss_mib
from tests.test_tinker_sdk import sft_data

LIMITS = HttpLimits()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Stack]:
    """A stack of this module's own: its first tests read the gateway's peak memory, which others would have set."""
    with tiny_stack(tmp_path_factory, model_cache) as s:
        yield s


def _fb(model_id: str, seq: int, tokens: np.ndarray, loss_fn: str = "cross_entropy") -> tp.ForwardBackwardRequest:
    """A Tinker forward_backward of one datum of ``tokens`` (targets: the tokens shifted by one)."""
    msg = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss_fn)
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = tokens.astype("<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(tp.Tensor(dense=np.roll(tokens, -1).astype("<i8").tobytes(),
                                                         dtype=tp.DTYPE_INT64, shape=[len(tokens)]))
    d.loss_fn_inputs["weights"].CopyFrom(tp.Tensor(dense=np.ones(len(tokens), "<f4").tobytes(),
                                                   dtype=tp.DTYPE_FLOAT32, shape=[len(tokens)]))
    return msg


# ---------- H3: memory bound per request before work (first in the module: they read the gateway's peak RSS) ----


def test_a_strangers_grpc_message_is_refused_before_it_is_read(stack: Stack) -> None:
    """Six concurrent 48 MiB messages without an API key: each UNAUTHENTICATED, and the gateway's peak memory grows
    by far less than one of them (grpc would otherwise take each in whole before any handler runs)."""
    before = _peak_rss_mib(stack, "gateway")
    blob = pb.Tensor(data=b"\0" * (48 * MIB), dtype="float32", shape=[12 * MIB])
    big = pb.ForwardBackwardRequest(model_id="m", seq_id=1, data=[pb_datum(TOKENS, weights=blob)])
    channel = grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS)
    stub = pb_grpc.GatewayStub(channel)

    def send(_: int) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            stub.ForwardBackward(big, timeout=WAIT_S)
        return e.value

    with cf.ThreadPoolExecutor(6) as pool:
        errors = list(pool.map(send, range(6)))
    assert {(e.code(), e.details()) for e in errors} == {
        (grpc.StatusCode.UNAUTHENTICATED, "missing API key: send it as the x-api-key header")}
    grown = _peak_rss_mib(stack, "gateway") - before
    print(f"gateway peak RSS grew by {grown:.0f} MiB over 6 x 48 MiB refused messages")
    assert grown < 100
    # health checks carry no key and still pass; a keyed call still works
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert Grpc(stack, "tml-h3").session().startswith("sess-")
    channel.close()


def test_a_zstd_bomb_is_refused_with_413_as_it_inflates(stack: Stack) -> None:
    """A few KB of zstd that inflate to a valid 64 MB forward_backward (16M token ids) answer 413 naming the limit,
    and the gateway's peak memory grows by far less than the 64 MB (the issue's gateway answered 200 and grew by
    818 MB)."""
    http = Http(stack, "tml-h3-bomb")
    model = http.model()
    before = _peak_rss_mib(stack, "gateway")
    msg = tp.ForwardBackwardRequest(model_id=model, seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = np.full(16_000_000, 7, "<i4").tobytes()
    bomb = zstandard.ZstdCompressor().compress(msg.SerializeToString())
    assert len(bomb) < 8 * 1024

    def send(_: int) -> tuple[int, dict, str | None]:
        r = http.http.post("/forward_backward", content=bomb, headers={"content-type": PROTO,
                                                                      "content-encoding": "zstd"})
        return r.status_code, r.json(), r.headers.get("x-should-retry")

    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(8)))
    limit = LIMITS.max_inflated_bytes
    for status, body, retry in answers:
        assert (status, body["category"], retry) == (413, "user", "false"), body
        assert body["error"] == (f"the zstd request body ({len(bomb)} bytes) decompresses to over the limit of "
                                 f"{limit} bytes (max_inflated_bytes)")
    grown = _peak_rss_mib(stack, "gateway") - before
    print(f"gateway peak RSS grew by {grown:.0f} MiB over 8 refused zstd bombs")
    assert grown < 100
    r = http.http.post("/forward_backward", content=b"x", headers={"content-type": PROTO, "content-encoding": "gzip"})
    http.refused(r, 400, r"Content-Encoding 'gzip' is not accepted; send 'zstd' or 'identity'")
    # the run is untouched: its first forward_backward and optim_step run
    ok = http.fb_proto(_fb(model, 1, np.asarray(TOKENS)))
    assert ok.status_code == 200 and PROTO in http.result(ok.json()["request_id"]).headers["content-type"]


def test_bodies_of_too_many_values_are_refused_before_they_become_lists(stack: Stack) -> None:
    http = Http(stack, "tml-h3-tokens")
    model = http.model()
    n = LIMITS.max_request_tokens + 1
    r = http.fb_proto(_fb(model, 1, np.full(n, 7)))
    http.refused(r, 400, rf"the request's model inputs hold {n} token ids, over the limit of {n - 1} "
                         r"\(max_request_tokens\)")
    sample = {"sampling_session_id": http.sampler(), "prompt": {"chunks": [{"tokens": [7] * n}]}}
    http.refused(http.post("/asample", sample), 400, rf"the request body holds up to \d+ JSON values \(one more than "
                                                     rf"its commas\), over the limit of {n - 1} \(max_request_tokens\)")


def test_the_decode_gate_holds_large_bodies_to_its_places_and_refuses_one_more() -> None:
    async def scenario() -> str:
        gate = DecodeGate(1, wait_s=0.01)
        async with gate.place(needed=False), gate.place(needed=True):  # a small body takes no place
            with pytest.raises(ResourceExhausted) as e:
                async with gate.place(needed=True):
                    pass
            assert e.value.retry_after_s == 1.0
        async with gate.place(needed=True):  # the place was given back
            pass
        return e.value.message

    assert asyncio.run(scenario()) == ("max_concurrent_decodes = 1: that many large requests (HTTP bodies "
                                       "compressed or over 1048576 bytes, gRPC forward_backward and sample messages) "
                                       "are being decoded, and this one waited 0 s for a place")


def test_the_grpc_door_reads_forward_backward_and_sample_only_with_a_place_of_the_gate() -> None:
    """A real grpc server with the gateway's interceptors: while the gate's one place is held, a keyed
    ForwardBackward waits for it and is refused RESOURCE_EXHAUSTED without its handler running (its message was not
    read); a stranger is refused at once without taking a place; other methods pass; with the place free the
    request reaches its handler whole."""
    class Recorder(pb_grpc.GatewayServicer):
        def __init__(self) -> None:
            self.seen: list[pb.ForwardBackwardRequest] = []

        async def ForwardBackward(self, request: pb.ForwardBackwardRequest, context: object) -> pb.SubmitResponse:
            self.seen.append(request)
            return pb.SubmitResponse(request_id="req-1", model_id=request.model_id)

        async def Whoami(self, request: pb.WhoamiRequest, context: object) -> pb.WhoamiResponse:
            return pb.WhoamiResponse(user_urn="alice")

    async def scenario() -> None:
        gate, recorder = DecodeGate(1, wait_s=0.2), Recorder()
        server = grpc.aio.server(interceptors=[RequireApiKey(ApiKeys.parse("tml-alice=alice\n")), GateDecodes(gate)],
                                 options=CHANNEL_OPTIONS)
        pb_grpc.add_GatewayServicer_to_server(recorder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        big = pb.ForwardBackwardRequest(model_id="m", seq_id=7, data=[pb_datum(TOKENS, weights=pb.Tensor(
            data=b"\1" * (8 * MIB), dtype="float32", shape=[2 * MIB]))])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GatewayStub(channel)
            keyed = [("x-api-key", "tml-alice")]
            async with gate.place(needed=True):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ForwardBackward(big, metadata=keyed, timeout=WAIT_S)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert e.value.details().startswith("max_concurrent_decodes = 1: that many large requests")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ForwardBackward(big, metadata=[("x-api-key", "tml-bob")], timeout=0.1)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert (await stub.Whoami(pb.WhoamiRequest(), metadata=keyed, timeout=WAIT_S)).user_urn == "alice"
                assert recorder.seen == []
            answer = await stub.ForwardBackward(big, metadata=keyed, timeout=WAIT_S)
            assert answer.model_id == "m" and recorder.seen == [big]
        await server.stop(None)

    asyncio.run(scenario())


# ---------- the null learning rate, and L6: a refusal while decoding passes over its seq_id ----------


def test_non_finite_adam_params_through_the_official_sdk_are_refused_and_the_run_goes_on(stack: Stack) -> None:
    """The SDK writes NaN and the infinities as JSON null; each is refused naming the field (never read as absent,
    which trained at the default 1e-4), and each refused optim_step passes over its seq_id: the next
    forward_backward + optim_step complete within the test's wait, far below the trainer's 300 s order wait."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-null-lr")
    tc = sc.create_lora_training_client(BASE, rank=4, seed=3).result()
    for field, value in (("learning_rate", math.nan), ("beta1", math.inf), ("beta2", -math.inf), ("eps", math.nan),
                         ("weight_decay", math.inf), ("grad_clip_norm", math.nan)):
        with pytest.raises(tinker.BadRequestError, match=re.escape(f"adam_params.{field} = null must be a finite "
                                                                   "number (the tinker SDK sends NaN and infinities "
                                                                   "as null)")):
            tc.optim_step(tinker.AdamParams(**{"learning_rate": 0.05, field: value})).result()
    fb_future = tc.forward_backward(sft_data(tinker), "cross_entropy")
    step = tc.optim_step(tinker.AdamParams(learning_rate=0.05)).result(timeout=WAIT_S)
    assert fb_future.result(timeout=WAIT_S).metrics["loss:sum"] > 0
    assert step.metrics["step:max"] == 1.0  # the first step applied: none of the refused ones ran
    sc.close("success").result()


def test_non_finite_adam_params_are_refused_by_name_through_lathes_own_sdk_and_grpc(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-null-lr-grpc") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4)
        for field in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"):
            with pytest.raises(lathe.InvalidArgument, match=rf"adam_params.{field} = nan must be a finite number"):
                tc.optim_step(lathe.AdamParams(**{field: math.nan}))
    door = Grpc(stack, "tml-null-lr-grpc")
    model = door.model()
    for seq, field in enumerate(("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"), 1):
        adam = pb.AdamParams()
        adam.CopyFrom(ADAM)
        setattr(adam, field, math.inf if seq % 2 else math.nan)
        door.refused("OptimStep", pb.OptimStepRequest(model_id=model, seq_id=seq, adam_params=adam),
                     grpc.StatusCode.INVALID_ARGUMENT, rf"adam_params.{field} = (inf|nan) must be a finite number")
    door.trains(model, 7)


def test_ordered_operations_refused_while_their_bodies_decode_do_not_hold_up_the_run(stack: Stack) -> None:
    """Four refusals made before the core sees the operation (a wrong type, too many tokens, an unknown custom
    loss, a bad save path), each at its own seq_id; the next forward_backward and optim_step answer within the
    test's wait (without the skips they would wait 300 s for seq_id 1)."""
    http = Http(stack, "tml-l6")
    model = http.model()
    http.refused(http.post("/optim_step", {"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": "fast"}}),
                 400, r'adam_params.learning_rate must be a number, got "fast"')
    http.refused(http.fb_proto(_fb(model, 2, np.full(LIMITS.max_request_tokens + 1, 7))), 400, "max_request_tokens")
    custom = _fb(model, 3, np.asarray(TOKENS), loss_fn="custom")
    custom.loss_fn_config_v2["loss_id"].text = "sess-none:loss:0"
    r = http.fb_proto(custom)
    assert r.status_code == 404 and "names no custom loss" in r.json()["error"], r.text
    http.refused(http.post("/save_weights", {"model_id": model, "seq_id": 4, "path": ["not", "a", "name"]}), 400,
                 r"path must be a string")
    fb = http.fb_proto(_fb(model, 5, np.asarray(TOKENS)))
    step = http.ok("/optim_step", {"model_id": model, "seq_id": 6, "adam_params": {"learning_rate": 0.01}})
    assert fb.status_code == 200 and PROTO in http.result(fb.json()["request_id"]).headers["content-type"]
    assert http.result(step["request_id"]).json()["metrics"]["step:max"] == 1.0


# ---------- H4: the recovery kind is the trainer's ----------


def test_a_recovery_snapshot_cannot_be_copied_re_ttled_published_or_deleted_through_either_door(stack: Stack) -> None:
    http, door = Http(stack, "tml-h4"), Grpc(stack, "tml-h4")
    model = http.model()
    http.result(http.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "keep"})["request_id"])
    snapshot = f"tinker://{model}/recovery/latest"
    assert http.ok("/weights_info", {"tinker_path": snapshot})["base_model"] == BASE  # the save snapshotted the run
    usage = http.http.get("/billing/usage/checkpoints/current").json()

    def message(action: str, path: str = snapshot) -> str:
        return (f"checkpoint {path!r} is a recovery snapshot: kind 'recovery' is reserved to the trainer, and its "
                f"checkpoints cannot be {action}")

    base = f"/training_runs/{model}/checkpoints/recovery/latest"
    for r, action in ((http.post("/copy_weights", {"source_path": snapshot}), "copied"),
                      (http.http.put(base + "/ttl", json={"ttl_seconds": 60}), "given another TTL"),
                      (http.http.put(base + "/ttl", json={"ttl_seconds": None}), "given another TTL"),
                      (http.http.post(base + "/publish"), "published"),
                      (http.http.delete(base), "deleted")):
        assert (r.status_code, r.json()) == (403, {"error": message(action), "category": "user"}), r.text
    for rpc, request, action in (
            ("CopyWeights", pb.CopyWeightsRequest(source_path=snapshot), "copied"),
            ("SetCheckpointTtl", pb.SetCheckpointTtlRequest(tinker_path=snapshot, ttl_seconds=60), "given another TTL"),
            ("SetCheckpointPublic", pb.SetCheckpointPublicRequest(tinker_path=snapshot, public=True), "published"),
            ("DeleteCheckpoint", pb.DeleteCheckpointRequest(tinker_path=snapshot), "deleted")):
        assert door.refused(rpc, request, grpc.StatusCode.PERMISSION_DENIED, "recovery snapshot") == message(action)
    # the same answer for a run that does not exist: the refusal says nothing of whose run it is
    missing = "tinker://sess-0000:train:0/recovery/latest"
    r = http.post("/copy_weights", {"source_path": missing})
    assert (r.status_code, r.json()["error"]) == (403, message("copied", missing))
    # nothing was made or lost: the snapshot is there, the listing and the usage are as they were
    assert http.ok("/weights_info", {"tinker_path": snapshot})["base_model"] == BASE
    assert http.http.get("/billing/usage/checkpoints/current").json() == usage
    listed = http.http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["weights/keep"]
