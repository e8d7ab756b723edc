"""Hostile requests through both real doors of a running stack (raw gRPC stubs, raw HTTP): each one is refused
with a clean client error naming the field, allocates nothing large, leaves no state, and every tenant (the
sender included) keeps training afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from lathe.channels import CHANNEL_OPTIONS
from lathe.stack import Stack
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from lathe.v1 import tinker_public_pb2 as tp
from tests.conftest import tiny_stack
from tests.helpers import pb_datum, pb_tensor

BASE = "lathe/tiny-llama"
PROTO = "application/x-protobuf"
WAIT_S = 60.0
TOKENS = [5, 17, 42, 9, 33, 120, 7]
ADAM = pb.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)
MIB = 1 << 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Stack]:
    """A stack of this module's own: a test reads the gateway's peak memory, which others would have set."""
    with tiny_stack(tmp_path_factory, model_cache) as s:
        yield s


class Grpc:
    """One tenant's raw view of the gRPC door."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.channel = grpc.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.GatewayStub(self.channel)
        self.md = (("x-api-key", key),)

    def call(self, rpc: str, request: object, timeout: float = WAIT_S) -> object:
        return getattr(self.stub, rpc)(request, metadata=self.md, timeout=timeout)

    def refused(self, rpc: str, request: object, code: grpc.StatusCode, pattern: str) -> str:
        with pytest.raises(grpc.RpcError) as e:
            self.call(rpc, request)
        assert e.value.code() == code and re.search(pattern, e.value.details()), (e.value.code(), e.value.details())
        return e.value.details()

    def result(self, request_id: str, timeout: float = WAIT_S) -> pb.FutureResult:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.call("RetrieveFuture", pb.RetrieveFutureRequest(request_id=request_id, timeout_s=5.0))
            if res.done:
                return res
        raise TimeoutError(f"{request_id} did not finish within {timeout} s")

    def session(self) -> str:
        return self.call("CreateSession", pb.CreateSessionRequest()).session_id

    def model(self, seed: int = 1, session: str | None = None) -> str:
        sub = self.call("CreateModel", pb.CreateModelRequest(
            session_id=session or self.session(), base_model=BASE,
            lora_config=pb.LoraConfig(rank=4, seed=seed, train_attn=True, train_mlp=True, train_unembed=True)))
        assert self.result(sub.request_id).WhichOneof("result") == "create_model"
        return sub.model_id

    def fb(self, model_id: str, seq: int, data: list[pb.Datum], loss_fn: str = "cross_entropy",
           **config: float) -> pb.FutureResult:
        sub = self.call("ForwardBackward", pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, data=data,
                                                                     loss_fn=loss_fn, loss_fn_config=config))
        return self.result(sub.request_id)

    def step(self, model_id: str, seq: int, adam: pb.AdamParams = ADAM) -> pb.FutureResult:
        sub = self.call("OptimStep", pb.OptimStepRequest(model_id=model_id, seq_id=seq, adam_params=adam))
        return self.result(sub.request_id)

    def trains(self, model_id: str, first_seq: int) -> None:
        """The run still trains: a forward_backward and its optim_step both succeed."""
        assert self.fb(model_id, first_seq, [pb_datum(TOKENS)]).WhichOneof("result") == "forward_backward"
        assert self.step(model_id, first_seq + 1).WhichOneof("result") == "optim_step"


class Http:
    """One tenant's raw view of the Tinker HTTP door."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.http = httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": key}, timeout=WAIT_S)

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        """POST ``body`` as Python's json writes it (NaN and Infinity included, as a hostile client sends)."""
        return self.http.post(path, content=json.dumps(body or {}), headers={"content-type": "application/json"})

    def ok(self, path: str, body: dict | None = None) -> dict:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    def refused(self, r: httpx.Response, status: int, pattern: str) -> None:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["category"] == "user" and re.search(pattern, body["error"]), body
        assert r.headers.get("x-should-retry") == "false"

    def result(self, request_id: str) -> httpx.Response:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            r = self.post("/retrieve_future", {"request_id": request_id})
            assert r.status_code == 200, r.text
            if PROTO in r.headers["content-type"] or r.json().get("type") != "try_again":
                return r
        raise TimeoutError(request_id)

    def model(self) -> str:
        session = self.ok("/create_session", {"user_metadata": {}})["session_id"]
        fut = self.ok("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                        "lora_config": {"rank": 4, "seed": 1}})
        assert self.result(fut["request_id"]).json() == {"model_id": fut["model_id"]}
        return fut["model_id"]

    def sampler(self) -> str:
        session = self.ok("/create_session", {"user_metadata": {}})["session_id"]
        return self.ok("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": BASE})["sampling_session_id"]

    def fb_proto(self, msg: tp.ForwardBackwardRequest) -> httpx.Response:
        return self.http.post("/forward_backward", content=msg.SerializeToString(), headers={"content-type": PROTO})


def _tp_request(model_id: str, seq: int, target: tp.Tensor) -> tp.ForwardBackwardRequest:
    msg = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(TOKENS[:6], "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(target)
    return msg


def _peak_rss_mib(stack: Stack, name: str) -> float:
    """The high-water mark of a service process's resident memory (VmHWM), in MiB."""
    pid = next(s.proc.pid for s in stack.services if s.name == name)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


# ---------- item 1: one request cannot stop training ----------


def test_negative_dimensions_fail_one_operation_and_every_tenant_keeps_training(stack: Stack) -> None:
    mallory, alice = Grpc(stack, "tml-h1-mallory"), Grpc(stack, "tml-h1-alice")
    bad_run, good_run = mallory.model(), alice.model()
    six = TOKENS[:6]
    hostile = pb_datum(six, target_tokens=pb_tensor(six, "int64", shape=[-2, -3]))  # -2 * -3 == 6 values
    res = mallory.fb(bad_run, 1, [pb_datum(TOKENS), hostile])
    assert res.error.code == "InvalidArgument", res
    assert res.error.message == "datum 1: loss_fn_inputs['target_tokens']: shape [-2, -3] has a negative dimension"
    alice.trains(good_run, 1)  # the trainer's cycle thread is alive for everyone ...
    mallory.trains(bad_run, 2)  # ... and for the sender, whose refused operation changed nothing

    # the HTTP door refuses such a shape itself, dense or sparse, before building anything
    http = Http(stack, "tml-h1-mallory")
    model = http.model()
    dense = tp.Tensor(dense=np.asarray(six, "<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=[-2, -3])
    http.refused(http.fb_proto(_tp_request(model, 1, dense)), 400,
                 r"data\[0\]\.loss_fn_inputs\['target_tokens'\]\.shape = \[-2, -3\] is not a shape")


# ---------- item 2: tiny requests, huge allocations ----------


def test_counts_and_sizes_are_refused_before_anything_is_allocated(stack: Stack) -> None:
    http, door = Http(stack, "tml-h2"), Grpc(stack, "tml-h2")
    rss_before = _peak_rss_mib(stack, "gateway")
    sampler = http.sampler()
    sample = {"sampling_session_id": sampler, "seq_id": 1, "prompt": {"chunks": [{"tokens": TOKENS}]},
              "sampling_params": {"max_tokens": 2}}
    http.refused(http.post("/asample", sample | {"num_samples": 2**31 - 1}), 400,
                 r"num_samples = 2147483647 must be in \[1, 128\]")
    http.refused(http.post("/asample", sample | {"num_samples": 1, "prompt_logprobs": True,
                                                 "topk_prompt_logprobs": 256}), 400,
                 r"topk_prompt_logprobs = 256 must be in \[0, 20\]")
    http.refused(http.post("/asample", sample | {"sampling_params": {"max_tokens": 2, "stop": ["x"] * 17}}), 400,
                 r"params.stop_strings has 17 entries, over the limit of 16")
    http.refused(http.post("/asample", sample | {"sampling_params": {"max_tokens": 2, "stop": ["y" * 257]}}), 400,
                 r"params.stop_strings\[0\] has 257 characters, over the limit of 256")
    assert http.result(http.ok("/asample", sample | {"num_samples": 2})["request_id"]).status_code == 200

    # the same limits at the gRPC door, before any future exists
    session = door.session()
    sid = door.call("CreateSamplingSession", pb.CreateSamplingSessionRequest(session_id=session,
                                                                             base_model=BASE)).sampling_session_id
    req = pb.SampleRequest(sampling_session_id=sid, prompt=TOKENS, num_samples=129,
                           params=pb.SamplingParams(max_tokens=2, temperature=1.0, top_p=1.0))
    door.refused("Sample", req, grpc.StatusCode.INVALID_ARGUMENT, r"num_samples = 129 must be in \[1, 128\]")

    # a sparse tensor of 10**10 cells with no values is refused, not densified (~40 GB)
    model = http.model()
    huge = tp.Tensor(sparse_csr=tp.SparseCsr(values=b"", crow_indices=np.asarray([0, 0], "<i8").tobytes(),
                                             col_indices=b""), dtype=tp.DTYPE_FLOAT32, shape=[1, 10**10])
    msg = _tp_request(model, 1, tp.Tensor(dense=np.asarray(TOKENS[1:7], "<i8").tobytes(), dtype=tp.DTYPE_INT64))
    msg.data[0].loss_fn_inputs["weights"].CopyFrom(huge)
    http.refused(http.fb_proto(msg), 400, r"loss_fn_inputs\['weights'\] holds 10000000000 values once dense")

    # bodies and messages over 64 MiB are refused: 413 at the HTTP door, RESOURCE_EXHAUSTED at the gRPC door
    caps = http.http.get("/get_server_capabilities").json()["limits"]
    limits = door.call("GetServerCapabilities", pb.GetServerCapabilitiesRequest()).limits
    assert {f.name: getattr(limits, f.name) for f in limits.DESCRIPTOR.fields} == caps == {
        "max_message_bytes": 64 * MIB, "max_samples": 128, "max_topk_prompt_logprobs": 20, "max_stop_sequences": 16,
        "max_stop_chars": 256, "max_tensor_elements": 16 * MIB, "max_sample_tokens": 128 * 8192}
    big = b"{" + b" " * (64 * MIB) + b"}"
    r = http.http.post("/create_session", content=big, headers={"content-type": "application/json"})
    http.refused(r, 413, r"the request body has 67108866 bytes, over the limit of 67108864 bytes")
    chunked = http.http.post("/create_session", content=iter([big[i:i + MIB] for i in range(0, len(big), MIB)]))
    http.refused(chunked, 413, r"the request body is over the limit of 67108864 bytes")
    blob = pb.Tensor(data=b"\0" * (65 * MIB), dtype="float32", shape=[65 * MIB // 4])
    door.refused("ForwardBackward", pb.ForwardBackwardRequest(
        model_id=model, seq_id=1, data=[pb_datum(TOKENS, weights=blob)]), grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max")
    # the gateway held none of it for long: its peak memory grew by far less than one refused body
    grown = _peak_rss_mib(stack, "gateway") - rss_before
    print(f"gateway peak RSS grew by {grown:.0f} MiB")
    assert grown < 400


# ---------- item 7: every parameter checked at the door ----------


def test_bad_parameters_are_client_errors_at_both_doors_and_leave_no_state(stack: Stack) -> None:
    http, door = Http(stack, "tml-h7"), Grpc(stack, "tml-h7")
    model = http.model()
    for adam, pattern in (({"learning_rate": math.nan}, "adam_params.learning_rate = nan must be a finite number"),
                          ({"learning_rate": math.inf}, "adam_params.learning_rate = inf must be a finite number"),
                          ({"eps": 0.0}, r"adam_params.eps = 0.0 must be > 0"),
                          ({"beta2": 1.0}, "adam_params.beta2 = 1.0 must be < 1"),
                          ({"weight_decay": -1.0}, "adam_params.weight_decay = -1.0 must be a finite number >= 0")):
        http.refused(http.post("/optim_step", {"model_id": model, "seq_id": 1, "adam_params": adam}), 400, pattern)
    for field, value, pattern in (("seq_id", 2**70, r"seq_id = 1180591620717411303424 is out of range"),
                                  ("seq_id", -3, r"seq_id must be >= 1, got -3")):
        http.refused(http.post("/optim_step", {"model_id": model, field: value, "adam_params": {}}), 400, pattern)
    session = http.ok("/create_session", {})["session_id"]
    http.refused(http.post("/create_model", {"session_id": session, "base_model": BASE, "model_seq_id": 0,
                                             "lora_config": {"rank": 2**40}}), 400, r"rank = 1099511627776 is out")
    http.refused(http.post("/save_weights", {"model_id": model, "seq_id": 1, "path": "forever",
                                             "ttl_seconds": 2**62}), 400, r"ttl_seconds = 4611686018427387904 must")
    http.refused(http.http.get("/checkpoints", params={"limit": "9" * 40}), 400, r"query parameter limit")
    sample = {"sampling_session_id": http.sampler(), "prompt": {"chunks": [{"tokens": TOKENS}]}}
    for params, pattern in (({"max_tokens": 2**40}, r"sampling_params.max_tokens = 1099511627776 is out of range"),
                            ({"temperature": math.nan}, r"sampling_params.temperature = nan must be a finite")):
        http.refused(http.post("/asample", sample | {"sampling_params": params}), 400, pattern)
    # the refused seq_id 1 was never registered: the same seq_id with good parameters runs
    fut = http.ok("/optim_step", {"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 0.01}})
    assert http.result(fut["request_id"]).json()["metrics"]["step:max"] == 1.0
    assert http.http.get("/checkpoints").status_code == 200  # listing never fails

    run = door.model()
    door.refused("OptimStep", pb.OptimStepRequest(model_id=run, seq_id=1, adam_params=pb.AdamParams(
        learning_rate=0.01, beta1=0.9, beta2=0.95)), grpc.StatusCode.INVALID_ARGUMENT, "adam_params.eps = 0.0")
    door.refused("Save", pb.SaveRequest(model_id=run, seq_id=1, name="x", kind="weights", ttl_seconds=2**62),
                 grpc.StatusCode.INVALID_ARGUMENT, "ttl_seconds = 4611686018427387904")
    n = len(TOKENS)

    def rl(seq: int, loss_fn: str, logprobs: list[float], **config: float) -> pb.FutureResult:
        d = pb_datum(TOKENS, logprobs=pb_tensor(logprobs, "float32"), advantages=pb_tensor([1.0] * n, "float32"))
        del d.loss_fn_inputs["weights"]
        return door.fb(run, seq, [d], loss_fn, **config)

    for seq, (loss_fn, lps, config, pattern) in enumerate((
            ("ppo", [-1.0] * (n - 1) + [0.25], {}, r"datum 0: loss_fn_inputs\['logprobs'\]\[6\] = 0.25 is positive"),
            ("ppo", [-1.0] * n, {"clip_low_threshold": 2.0}, "clip_low_threshold = 2.0 is above clip_high"),
            ("dro", [-1.0] * n, {"beta": -1.0}, r"loss_fn_config\['beta'\] = -1.0 must be a finite number >= 0"),
    ), start=1):
        res = rl(seq, loss_fn, lps, **config)
        assert res.error.code == "InvalidArgument" and re.search(pattern, res.error.message), res.error
    door.trains(run, 4)


def test_another_tenants_checkpoint_is_not_found_exactly_as_a_missing_one(stack: Stack) -> None:
    alice, bob = Http(stack, "tml-h7-alice"), Http(stack, "tml-h7-bob")
    model = alice.model()
    path = alice.result(alice.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "keep"})["request_id"]
                        ).json()["path"]
    missing = path.replace("/keep", "/never-saved")

    def answers(api: Http, p: str) -> list[tuple[int, str]]:
        run, _, name = p.removeprefix("tinker://").partition("/")
        session = api.ok("/create_session", {})["session_id"]
        rs = [api.post("/weights_info", {"tinker_path": p}),
              api.http.delete(f"/training_runs/{run}/checkpoints/{name}"),
              api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "model_path": p})]
        return [(r.status_code, r.json()["error"].replace(p, "<path>")) for r in rs]

    assert answers(bob, path) == answers(bob, missing) == [(404, "checkpoint <path> not found")] * 3
    g_bob = Grpc(stack, "tml-h7-bob")
    session = g_bob.session()
    details = [g_bob.refused("CreateSamplingSession", pb.CreateSamplingSessionRequest(session_id=session,
                                                                                      model_path=p),
                             grpc.StatusCode.NOT_FOUND, "not found").replace(p, "<path>") for p in (path, missing)]
    assert details[0] == details[1]
    assert alice.post("/weights_info", {"tinker_path": path}).status_code == 200  # still there for its owner


# ---------- item 6: a failed run answers, it does not hang ----------


def test_a_run_whose_adapter_cannot_be_created_answers_its_waiters(stack: Stack) -> None:
    door = Grpc(stack, "tml-h6")
    for _ in range(3):
        session = door.session()
        nothing = pb.LoraConfig(rank=4, train_attn=False, train_mlp=False, train_unembed=False)  # trains nothing
        create = door.stub.CreateModel.future(pb.CreateModelRequest(session_id=session, base_model=BASE,
                                                                    lora_config=nothing), metadata=door.md)
        info = door.stub.GetInfo.future(pb.GetInfoRequest(model_id=f"{session}:train:0"), metadata=door.md,
                                        timeout=20)
        op = door.stub.OptimStep.future(pb.OptimStepRequest(model_id=f"{session}:train:0", seq_id=1,
                                                            adam_params=ADAM), metadata=door.md, timeout=20)
        assert door.result(create.result().request_id).error.code == "InvalidArgument"
        for call in (info, op):
            try:
                answer = call.result()
            except grpc.RpcError as e:  # it arrived after the run was dropped, or while it waited for it
                assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), e
            else:  # the operation was submitted while the run was being created: its future has the error
                assert door.result(answer.request_id).error.code == "InvalidArgument"


# ---------- item 3: admission errors are not results; one tenant cannot fill the queue ----------


def test_an_admission_error_is_not_remembered_as_the_result_of_its_seq_id(stack: Stack) -> None:
    """A full trainer queue never fails an operation the door accepted (it waits, "paused_capacity"); the
    tenant's next ones are refused at the door before anything is recorded, so their retry runs once."""
    flooder, victim = Grpc(stack, "tml-h3-flood"), Grpc(stack, "tml-h3-victim")
    run, other = flooder.model(), victim.model()
    share = 1024  # the trainer's default max_queue_per_tenant
    with cf.ThreadPoolExecutor(8) as pool:
        subs = list(pool.map(lambda seq: flooder.call("OptimStep", pb.OptimStepRequest(
            model_id=run, seq_id=seq, adam_params=ADAM)).request_id, range(2, share + 2)))  # never seq 1
    held, seq, refused = {}, share + 2, None  # seq_id -> request id of operations the door accepted
    deadline = time.monotonic() + WAIT_S  # bounded: once the trainer refuses one, the gateway parks it
    while refused is None and time.monotonic() < deadline:
        try:
            held[seq] = flooder.call("OptimStep", pb.OptimStepRequest(model_id=run, seq_id=seq,
                                                                      adam_params=ADAM)).request_id
            seq += 1
            time.sleep(0.05)
        except grpc.RpcError as e:
            refused = e
    assert refused is not None, "the door kept accepting while the tenant's trainer queue was full"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert re.search(r"the trainer queue of '.+' is full for this tenant \(\d+ operations waiting for a place\); "
                     r"retry in 1 s", refused.details()), refused.details()
    first = held[share + 2]
    assert not flooder.call("RetrieveFuture", pb.RetrieveFutureRequest(request_id=first, timeout_s=0.5)).done
    victim.trains(other, 1)  # the shared queue still has room for everyone else
    assert flooder.step(run, 1).WhichOneof("result") == "optim_step"  # the awaited one is always let in
    assert flooder.result(subs[-1], timeout=120).WhichOneof("result") == "optim_step"
    for s_id, request_id in held.items():  # held while the queue was full, never failed
        assert flooder.result(request_id, timeout=120).optim_step.metrics["step:max"] == s_id
    retry = flooder.call("OptimStep", pb.OptimStepRequest(model_id=run, seq_id=seq, adam_params=ADAM))
    assert flooder.result(retry.request_id).optim_step.metrics["step:max"] == seq  # the refused one, applied once
