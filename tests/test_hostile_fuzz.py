"""Fuzzing both doors of a running stack with hypothesis: malformed JSON and protobuf bodies on the HTTP door,
hostile field values in every request message of the gRPC door. Every reply must be a clean client error
(HTTP 4xx with Tinker's error body / a gRPC client status) or an acceptance, never a server error or a hang;
operations the doors accepted must not fail with a server error either; and a training run that shares the
stack ends exactly as an undisturbed one.

The generators know each endpoint's field names and the ids that exist (so values reach the checks behind
the type checks) and draw values from the hostile end: negative and huge integers, NaN and infinities, lone
surrogates, wrong types, negative and huge dimensions, truncated and random bytes. Derandomized, so a
failure reproduces; ``FUZZ_EXAMPLES`` scales the counts (default 1: a few hundred requests in under a minute).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

# hypothesis keeps caches in ./.hypothesis unless told otherwise: not in the repository
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "lathe-hypothesis"))
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lathe
from lathe.channels import CHANNEL_OPTIONS
from lathe.stack import Stack
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from lathe.v1 import tinker_public_pb2 as tp
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
KEY = "tml-fuzzer"
SCALE = int(os.environ.get("FUZZ_EXAMPLES", "1"))
TIMEOUT_S = 30.0  # no reply may take longer (a long-poll on an unknown id answers at once)
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE}
FUZZ = settings(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=list(HealthCheck))

INT64 = (-2**63, 2**63 - 1)
EDGE_INTS = [0, 1, -1, 2, 7, 128, 129, 2**31 - 1, -2**31, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -2**63, 2**63, 2**70,
             -2**70, 10**30]
hostile_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-1000, 1000), st.integers(-2**80, 2**80))
hostile_floats = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-300, 1e300, 2.0, 0.5]),
                           st.floats(allow_nan=True, allow_infinity=True))
hostile_text = st.one_of(st.text(max_size=20), st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "../../etc/passwd",
                                                                "tinker://x/weights/y", "x" * 300, "%s%n",
                                                                "tinker://../weights/a", "NaN"]))


@dataclass(slots=True)
class Targets:
    """Ids that exist for the fuzzing tenant (so fuzzed requests reach the checks behind the lookups), and
    what the fuzz saw."""

    model_id: str
    session_id: str
    sampling_session_id: str
    path: str
    accepted: list[tuple[str, str]] = field(default_factory=list)  # (door, request id) of accepted operations
    seen: collections.Counter = field(default_factory=collections.Counter)

    def known(self, name: str) -> str | None:
        """The existing id a string field called ``name`` names, if any."""
        return {"model_id": self.model_id, "training_run_id": self.model_id, "session_id": self.session_id,
                "sampling_session_id": self.sampling_session_id, "path": self.path, "model_path": self.path,
                "tinker_path": self.path, "base_model": BASE}.get(name)

    def strings(self) -> list[str]:
        return [self.model_id, self.session_id, self.sampling_session_id, self.path, BASE, "cross_entropy", "ppo",
                "weights", "sampler_weights", "target_tokens", "weights", "logprobs", "advantages", "adamw"]


def _values(t: Targets) -> st.SearchStrategy:
    """Any JSON value, from the hostile end, with known ids and names mixed in."""
    scalars = st.one_of(st.none(), st.booleans(), hostile_ints, hostile_floats, hostile_text,
                        st.sampled_from(t.strings()))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(hostile_text, inner, max_size=4)),
                        max_leaves=12)


# ---------- the stack, the fuzzing tenant and the training run beside ----------

DATA = [next_token_datum(t) for t in ([5, 17, 42, 9, 33, 120, 7, 88], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38])]


def _train(tc: lathe.TrainingClient, steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward(DATA, "cross_entropy")
        tc.optim_step(lathe.AdamParams(learning_rate=0.02)).result()


def _logprobs(tc: lathe.TrainingClient) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in tc.forward(DATA).result().loss_fn_outputs]


@pytest.fixture(scope="module")
def targets(stack: Stack) -> Iterator[Targets]:
    with lathe.ServiceClient(base_url=stack.gateway, api_key=KEY) as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=11)
        path = tc.save_state("fuzz-target").result().path
        sampler = sc.create_sampling_client(base_model=BASE)
        session = tc.model_id.split(":")[0]
        yield Targets(tc.model_id, session, sampler.sampling_session_id, path)


@pytest.fixture(scope="module")
def bystander(stack: Stack) -> Iterator[tuple[lathe.TrainingClient, lathe.TrainingClient]]:
    """Two identical runs of another tenant: one trains before and after the fuzz, one entirely before it."""
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bystander") as sc:
        beside = sc.create_lora_training_client(BASE, rank=4, seed=5)
        alone = sc.create_lora_training_client(BASE, rank=4, seed=5)
        _train(alone, 4)
        _train(beside, 2)
        yield beside, alone


# ---------- HTTP door ----------

HTTP_FIELDS: dict[str, list[str]] = {
    "/create_session": ["user_metadata", "tags", "sdk_version"],
    "/session_heartbeat": ["session_id"],
    "/create_model": ["session_id", "model_seq_id", "base_model", "lora_config", "optimizer_config",
                      "user_metadata"],
    "/get_info": ["model_id"],
    "/optim_step": ["model_id", "seq_id", "adam_params", "optimizer_params"],
    "/save_weights": ["model_id", "seq_id", "path", "ttl_seconds", "overwrite", "user_metadata"],
    "/save_weights_for_sampler": ["model_id", "seq_id", "path", "ttl_seconds", "sampling_session_seq_id",
                                  "user_metadata"],
    "/load_weights": ["model_id", "seq_id", "path", "optimizer", "session_id", "model_seq_id", "base_model",
                      "weights_access_token"],
    "/create_sampling_session": ["session_id", "sampling_session_seq_id", "model_path", "base_model"],
    "/asample": ["sampling_session_id", "seq_id", "prompt", "sampling_params", "num_samples", "prompt_logprobs",
                 "topk_prompt_logprobs", "prompt_logprobs_last_n", "topk_sample_logprobs"],
    "/retrieve_future": ["request_id"],
    "/weights_info": ["tinker_path"],
}
NESTED: dict[str, list[str]] = {  # fields whose value is an object with fields of its own
    "lora_config": ["rank", "seed", "train_mlp", "train_attn", "train_unembed"],
    "adam_params": ["learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"],
    "sampling_params": ["max_tokens", "seed", "stop", "temperature", "top_k", "top_p"],
    "prompt": ["chunks"],
    "optimizer_config": ["type"],
}
GETS = ["/get_server_capabilities", "/training_runs", "/training_runs/{m}", "/training_runs/{m}/checkpoints",
        "/checkpoints", "/samplers/{s}", "/training_runs/{x}", "/samplers/{x}", "/no/such/route"]


@st.composite
def _json_body(draw: st.DrawFn, t: Targets) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(HTTP_FIELDS)))
    values = _values(t)
    kind = draw(st.sampled_from(["fields", "fields", "fields", "not-an-object", "bytes"]))
    if kind == "bytes":
        valid = json.dumps({"model_id": t.model_id, "seq_id": 1}).encode()
        return path, draw(st.one_of(st.binary(max_size=64), st.just(valid[:draw(st.integers(0, len(valid)))]),
                                    st.just(b"[" * 5000), st.just(b'{"seq_id": ' + b"9" * 5000 + b"}"),
                                    st.just(b'{"model_id": "\\ud800"}')))
    if kind == "not-an-object":
        return path, json.dumps(draw(values)).encode()
    body: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(HTTP_FIELDS[path]), max_size=6)):
        if name in NESTED and draw(st.booleans()):
            body[name] = {n: draw(values) for n in draw(st.lists(st.sampled_from(NESTED[name]), max_size=6))}
        elif name == "prompt" and draw(st.booleans()):
            body[name] = {"chunks": [{"type": draw(st.sampled_from(["encoded_text", "image"])),
                                      "tokens": draw(st.lists(hostile_ints, max_size=6))}]}
        else:
            body[name] = draw(values)
    if isinstance(body.get("sampling_params"), dict):  # an accepted sample decodes a few tokens, not the context
        body["sampling_params"].setdefault("max_tokens", 3)
    return path, json.dumps(body).encode()


@st.composite
def _tensor_msg(draw: st.DrawFn) -> tp.Tensor:
    shape = draw(st.lists(st.one_of(st.sampled_from([-3, -2, -1, 0, 1, 6, 10**10, 2**40]), st.integers(0, 8)),
                          max_size=9))
    dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 99]))
    if draw(st.booleans()):
        return tp.Tensor(dense=draw(st.binary(max_size=96)), dtype=dtype, shape=shape)
    ints = st.lists(st.sampled_from([-1, 0, 1, 2, 6, 2**40]), max_size=4)
    return tp.Tensor(sparse_csr=tp.SparseCsr(values=draw(st.binary(max_size=32)),
                                             crow_indices=np.asarray(draw(ints), "<i8").tobytes(),
                                             col_indices=np.asarray(draw(ints), "<i8").tobytes()),
                     dtype=dtype, shape=shape)


@st.composite
def _forward_backward_body(draw: st.DrawFn, t: Targets) -> bytes:
    msg = tp.ForwardBackwardRequest(model_id=draw(st.sampled_from([t.model_id, "", "nope"])),
                                    seq_id=draw(st.sampled_from([-1, 0, 10**6, 2**31 - 1])),
                                    loss_fn=draw(st.sampled_from(["cross_entropy", "ppo", "dro", "", "hinge"])),
                                    forward_only=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = draw(st.binary(max_size=40))
        for name in draw(st.lists(st.sampled_from(["target_tokens", "weights", "logprobs", "advantages", "x"]),
                                  max_size=4)):
            d.loss_fn_inputs[name].CopyFrom(draw(_tensor_msg()))
    for key in draw(st.lists(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "zzz"]),
                             max_size=3)):
        msg.loss_fn_config[key] = draw(hostile_floats)
    body = msg.SerializeToString()
    return draw(st.one_of(st.just(body), st.just(body[:draw(st.integers(0, len(body)))]), st.binary(max_size=64)))


class HttpFuzzer:
    def __init__(self, stack: Stack, t: Targets) -> None:
        self.http = httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": KEY},
                                 timeout=TIMEOUT_S)
        self.t = t

    def check(self, r: httpx.Response, what: str) -> None:
        self.t.seen[f"http {r.status_code}"] += 1
        assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            body = r.json()
            assert set(body) == {"error", "category"} and body["category"] == "user", (what, body)
        elif r.headers.get("content-type") == "application/json" and "request_id" in r.json():
            self.t.accepted.append(("http", r.json()["request_id"]))


def test_http_door_answers_malformed_bodies_with_client_errors(stack: Stack, targets: Targets,
                                                               bystander: tuple) -> None:
    fuzzer = HttpFuzzer(stack, targets)

    @settings(FUZZ, max_examples=250 * SCALE)
    @given(st.data())
    def json_bodies(data: st.DataObject) -> None:
        path, body = data.draw(_json_body(targets))
        headers = {"content-type": "application/json"}
        if path == "/retrieve_future":
            headers["x-stainless-read-timeout"] = "16"  # an accepted id long-polls 1 s at most
        fuzzer.check(fuzzer.http.post(path, content=body, headers=headers), f"POST {path} {body[:200]!r}")

    @settings(FUZZ, max_examples=100 * SCALE)
    @given(st.data())
    def protobuf_bodies(data: st.DataObject) -> None:
        body = data.draw(_forward_backward_body(targets))
        r = fuzzer.http.post("/forward_backward", content=body, headers={"content-type": "application/x-protobuf"})
        fuzzer.check(r, f"POST /forward_backward {body[:200]!r}")

    @settings(FUZZ, max_examples=50 * SCALE)
    @given(st.sampled_from(GETS), st.text(max_size=12), st.dictionaries(st.sampled_from(["limit", "offset", "x"]),
                                                                         st.one_of(st.text(max_size=12),
                                                                                   hostile_ints.map(str)), max_size=2))
    def paths_and_queries(path: str, segment: str, query: dict[str, str]) -> None:
        url = path.format(m=targets.model_id, s=targets.sampling_session_id,
                          x=urllib.parse.quote(segment, safe="") or "x")
        fuzzer.check(fuzzer.http.get(url, params=query), f"GET {url} {query}")

    json_bodies()
    protobuf_bodies()
    paths_and_queries()


# ---------- gRPC door ----------

RPCS = {m.name: (m.input_type, m.output_type) for m in pb.DESCRIPTOR.services_by_name["Gateway"].methods}
INT_RANGES = {FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
              FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_SINT64: INT64,
              FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1)}


def _scalar(draw: st.DrawFn, f: FieldDescriptor, t: Targets) -> object:
    if f.type in INT_RANGES:
        lo, hi = INT_RANGES[f.type]
        return draw(st.one_of(st.sampled_from([v for v in EDGE_INTS if lo <= v <= hi]), st.integers(lo, hi)))
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return draw(hostile_floats if f.type == FieldDescriptor.TYPE_DOUBLE else
                    st.floats(width=32, allow_nan=True, allow_infinity=True))
    if f.type == FieldDescriptor.TYPE_BOOL:
        return draw(st.booleans())
    if f.type == FieldDescriptor.TYPE_BYTES:
        return draw(st.one_of(st.binary(max_size=48), st.just(np.asarray([1, 2, 3, 4, 5, 6], "<i8").tobytes())))
    if f.type == FieldDescriptor.TYPE_ENUM:
        return draw(st.integers(0, 5))
    known = t.known(f.name)
    if known is not None and draw(st.integers(0, 3)):
        return known
    return draw(st.one_of(st.sampled_from(t.strings() + ["int64", "float32", "int32", "bfloat16"]),
                          st.text(max_size=20)))


def _fill(draw: st.DrawFn, msg: Message, t: Targets, depth: int = 0) -> Message:
    """Set a random subset of ``msg``'s fields to hostile values, recursing into messages, lists and maps."""
    d: Descriptor = msg.DESCRIPTOR
    for f in d.fields:
        if not draw(st.booleans()):
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            target = getattr(msg, f.name)
            for _ in range(draw(st.integers(0, 3))):
                key = _scalar(draw, key_f, t)
                if val_f.message_type is not None:
                    _fill(draw, target[key], t, depth + 1)
                else:
                    target[key] = _scalar(draw, val_f, t)
        elif f.is_repeated:
            target = getattr(msg, f.name)
            for _ in range(draw(st.integers(0, 4 if depth < 3 else 0))):
                if f.message_type is not None:
                    _fill(draw, target.add(), t, depth + 1)
                else:
                    target.append(_scalar(draw, f, t))
        elif f.message_type is not None:
            if depth < 4:
                _fill(draw, getattr(msg, f.name), t, depth + 1)
                getattr(msg, f.name).SetInParent()
        else:
            setattr(msg, f.name, _scalar(draw, f, t))
    return msg


@st.composite
def _grpc_request(draw: st.DrawFn, t: Targets) -> tuple[str, Message]:
    rpc = draw(st.sampled_from(sorted(RPCS)))
    msg = _fill(draw, getattr(pb, RPCS[rpc][0].name)(), t)
    if rpc == "RetrieveFuture":
        msg.timeout_s = min(msg.timeout_s, 1.0) if msg.timeout_s == msg.timeout_s else 1.0
    if rpc == "Sample":  # an accepted sample decodes a few tokens, not the context; the rest stays hostile
        msg.params.max_tokens = draw(st.sampled_from([3, 1, 0, -5, 600, 2**31 - 1]))
    return rpc, msg


def test_grpc_door_answers_hostile_messages_with_client_errors(stack: Stack, targets: Targets,
                                                               bystander: tuple) -> None:
    channel = grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS)
    stub = pb_grpc.GatewayStub(channel)

    @settings(FUZZ, max_examples=300 * SCALE)
    @given(st.data())
    def messages(data: st.DataObject) -> None:
        rpc, msg = data.draw(_grpc_request(targets))
        try:
            reply = getattr(stub, rpc)(msg, metadata=(("x-api-key", KEY),), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            targets.seen[f"grpc {e.code().name}"] += 1
            assert e.code() in CLIENT_CODES, f"{rpc}({msg}) -> {e.code()}: {e.details()}"
            return
        targets.seen["grpc OK"] += 1
        if isinstance(reply, pb.SubmitResponse):
            targets.accepted.append(("grpc", reply.request_id))

    messages()
    channel.close()


# ---------- afterwards ----------


def test_accepted_operations_failed_cleanly_and_the_run_beside_is_untouched(stack: Stack, targets: Targets,
                                                                             bystander: tuple) -> None:
    """Run last: what the doors accepted never ended in a server error, and the bystander's run, trained
    before and after the fuzz, equals the one trained undisturbed."""
    channel = grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS)
    stub = pb_grpc.GatewayStub(channel)
    time.sleep(2.0)  # let what was accepted run
    finished = 0
    for _, request_id in targets.accepted:
        res = stub.RetrieveFuture(pb.RetrieveFutureRequest(request_id=request_id, timeout_s=0.0),
                                  metadata=(("x-api-key", KEY),), timeout=TIMEOUT_S)
        if res.done:
            finished += 1
            assert not (res.WhichOneof("result") == "error" and res.error.category == "server"), res
    channel.close()
    beside, alone = bystander
    _train(beside, 2)
    assert all(np.array_equal(a, b) for a, b in zip(_logprobs(beside), _logprobs(alone), strict=True))
    print(f"\nfuzz replies: {dict(sorted(targets.seen.items()))}; accepted {len(targets.accepted)}, "
          f"{finished} of them finished")
    assert sum(targets.seen.values()) >= 600 * SCALE

