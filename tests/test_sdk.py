"""Lathe's SDK against an in-process fake ``lathe.v1.Gateway``: wire round trips, Datum conversions, seq_id
order and retries, long-polled futures, error mapping, the API key, the REST client."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message

import lathe
from lathe import info_wire, service_client, wire
from lathe.futures import RetryPolicy
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from tests.helpers import next_token_datum

KEY = "tml-test"
BASE = "fake/base"
Ctx = grpc.ServicerContext


class FakeGateway(pb_grpc.GatewayServicer):
    """Just enough of the gateway: records every call (name, request, metadata), answers training ops at
    once with canned results that echo their request, and holds each poll at most ``hold_s``."""

    hold_s = 0.15

    def __init__(self) -> None:
        self.calls: list[tuple[str, Message, dict[str, str]]] = []
        self.inject: dict[str, list[grpc.StatusCode]] = {}  # rpc -> codes its next calls abort with
        self.errors: dict[str, pb.Error] = {}  # rpc -> the error its futures finish with
        self.delay_s = 0.0  # a future's result is ready this long after its submit
        self.futures: dict[str, tuple[float, pb.FutureResult]] = {}  # request id -> (ready at, result)
        self.by_seq: dict[tuple[str, int], str] = {}
        self.sessions = 0
        self.models = 0
        self.lock = threading.Lock()

    # ---- helpers ----

    def _enter(self, rpc: str, request: Message, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls.append((rpc, request, dict(context.invocation_metadata())))
            codes = self.inject.get(rpc)
            code = codes.pop(0) if codes else None
        if code is not None:
            context.abort(code, f"injected {rpc} failure")

    def _future(self, rpc: str, result: pb.FutureResult) -> str:
        with self.lock:
            rid = f"req-{len(self.futures) + 1}"
            if rpc in self.errors:
                result = pb.FutureResult(error=self.errors[rpc])
            self.futures[rid] = (time.monotonic() + self.delay_s, result)
        return rid

    def _op(self, rpc: str, request: Message, context: grpc.ServicerContext, value: object) -> pb.SubmitResponse:
        self._enter(rpc, request, context)
        key = (request.model_id, request.seq_id)
        if key not in self.by_seq:
            receipt = lathe.Receipt(request_id="", model_id=request.model_id, seq_id=request.seq_id, cycle=7,
                                    tokens=3, adapter_step=0, queued_s=0.5, run_s=0.25, dtype="float32",
                                    op=rpc, fingerprint="f00d", exact=True)
            value.receipt = receipt
            self.by_seq[key] = self._future(rpc, wire.result_to_proto(value))
        return pb.SubmitResponse(request_id=self.by_seq[key], model_id=request.model_id)

    def calls_of(self, rpc: str) -> list[Message]:
        return [req for name, req, _ in self.calls if name == rpc]

    # ---- sessions and models ----

    def CreateSession(self, request: pb.CreateSessionRequest, context: Ctx) -> pb.CreateSessionResponse:
        self._enter("CreateSession", request, context)
        self.sessions += 1
        return pb.CreateSessionResponse(session_id=f"sess-{self.sessions}")

    def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.Empty:
        self._enter("Heartbeat", request, context)
        return pb.Empty()

    def GetServerCapabilities(self, request: pb.GetServerCapabilitiesRequest, context: Ctx) -> pb.ServerCapabilities:
        self._enter("GetServerCapabilities", request, context)
        return info_wire.capabilities_to_proto(lathe.GetServerCapabilitiesResponse([lathe.SupportedModel(BASE, 2048)]))

    def _create(self, rpc: str, request: Message, context: grpc.ServicerContext) -> pb.SubmitResponse:
        self._enter(rpc, request, context)
        model_id = f"{request.session_id}:train:{self.models}"
        self.models += 1
        rid = self._future(rpc, wire.result_to_proto(lathe.CreateModelResponse(model_id)))
        return pb.SubmitResponse(request_id=rid, model_id=model_id)

    def CreateModel(self, request: pb.CreateModelRequest, context: Ctx) -> pb.SubmitResponse:
        return self._create("CreateModel", request, context)

    def CreateModelFromState(self, request: pb.CreateModelFromStateRequest, context: Ctx) -> pb.SubmitResponse:
        return self._create("CreateModelFromState", request, context)

    def GetInfo(self, request: pb.GetInfoRequest, context: Ctx) -> pb.ModelInfo:
        self._enter("GetInfo", request, context)
        return pb.ModelInfo(model_id=request.model_id, base_model=BASE, lora_config=pb.LoraConfig(rank=8),
                            tokenizer_id=BASE, max_context_length=2048)

    # ---- ordered operations ----

    def ForwardBackward(self, request: pb.ForwardBackwardRequest, context: Ctx) -> pb.SubmitResponse:
        outs = [{"logprobs": lathe.TensorData.from_numpy(-wire.tensor_from_proto(d.loss_fn_inputs["target_tokens"])
                                                          .to_numpy().astype(np.float32))}
                for d in request.data]
        value = lathe.ForwardBackwardOutput("ArrayRecord", outs, {"loss:sum": float(request.seq_id)})
        return self._op("ForwardBackward", request, context, value)

    def OptimStep(self, request: pb.OptimStepRequest, context: Ctx) -> pb.SubmitResponse:
        value = lathe.OptimStepResponse({"lr": request.adam_params.learning_rate})
        return self._op("OptimStep", request, context, value)

    def Save(self, request: pb.SaveRequest, context: Ctx) -> pb.SubmitResponse:
        path = f"tinker://{request.model_id}/{request.kind}/{request.name}"
        kind = lathe.SaveWeightsResponse if request.kind == "weights" else lathe.SaveWeightsForSamplerResponse
        return self._op("Save", request, context, kind(path))

    def Load(self, request: pb.LoadRequest, context: Ctx) -> pb.SubmitResponse:
        return self._op("Load", request, context, lathe.LoadWeightsResponse(request.path, request.model_id))

    def RetrieveFuture(self, request: pb.RetrieveFutureRequest, context: Ctx) -> pb.FutureResult:
        self._enter("RetrieveFuture", request, context)
        if request.request_id not in self.futures:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request_id {request.request_id!r}")
        ready_at, result = self.futures[request.request_id]
        wait = min(request.timeout_s, self.hold_s)
        if ready_at - time.monotonic() > wait:
            time.sleep(wait)
            return pb.FutureResult(request_id=request.request_id, done=False)
        time.sleep(max(0.0, ready_at - time.monotonic()))
        out = pb.FutureResult()
        out.CopyFrom(result)
        out.request_id, out.done = request.request_id, True
        return out

    # ---- registry ----

    def _run(self, run_id: str) -> lathe.TrainingRun:
        t = datetime(2025, 1, 2, tzinfo=UTC)
        return lathe.TrainingRun(run_id, BASE, lathe.LoraConfig(rank=8, seed=3), t, t, {"renderer_name": "x"},
                                 last_checkpoint=lathe.Checkpoint.from_tinker_path(f"tinker://{run_id}/weights/a"))

    def ListTrainingRuns(self, request: pb.ListTrainingRunsRequest, context: Ctx) -> pb.ListTrainingRunsResponse:
        self._enter("ListTrainingRuns", request, context)
        runs = [self._run(f"sess-1:train:{i}") for i in range(request.offset, request.offset + request.limit)]
        return info_wire.training_runs_to_proto(lathe.TrainingRunsResponse(runs, lathe.Cursor(0, 0, 50)))

    def GetTrainingRun(self, request: pb.GetTrainingRunRequest, context: Ctx) -> pb.TrainingRun:
        self._enter("GetTrainingRun", request, context)
        if not request.training_run_id.startswith("sess-"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model_id {request.training_run_id!r}")
        return info_wire.training_run_to_proto(self._run(request.training_run_id))

    def ListCheckpoints(self, request: pb.ListRunCheckpointsRequest, context: Ctx) -> pb.ListRunCheckpointsResponse:
        self._enter("ListCheckpoints", request, context)
        run = request.training_run_id or "sess-1:train:0"
        ckpts = [lathe.Checkpoint(f"weights/c{i}", "training", f"tinker://{run}/weights/c{i}",
                                  datetime.fromtimestamp(1000 + i, UTC), 10 * i) for i in range(3)]
        return info_wire.checkpoints_to_proto(lathe.CheckpointsListResponse(ckpts, lathe.Cursor(0, 0, 9)))

    def DeleteCheckpoint(self, request: pb.DeleteCheckpointRequest, context: Ctx) -> pb.Empty:
        self._enter("DeleteCheckpoint", request, context)
        return pb.Empty()

    def CreateSamplingSession(self, request: pb.CreateSamplingSessionRequest, context: Ctx) -> pb.SamplingSession:
        self._enter("CreateSamplingSession", request, context)
        return pb.SamplingSession(sampling_session_id=f"{request.session_id}:sample:0",
                                  base_model=request.base_model or BASE, model_path=request.model_path)


@pytest.fixture
def fake() -> Iterator[tuple[FakeGateway, str]]:
    gw = FakeGateway()
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_GatewayServicer_to_server(gw, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield gw, f"127.0.0.1:{port}"
    server.stop(grace=None)


FAST_RETRY = RetryPolicy(first_s=0.01, max_s=0.05, budget_s=0.3)


@pytest.fixture
def sc(fake: tuple[FakeGateway, str]) -> Iterator[lathe.ServiceClient]:
    with lathe.ServiceClient(fake[1], api_key=KEY, retry=FAST_RETRY) as client:
        yield client


@pytest.fixture
def gw(fake: tuple[FakeGateway, str]) -> FakeGateway:
    return fake[0]


# ---------- types and wire ----------

RECEIPT = lathe.Receipt("req-1", "m:train:0", 4, 9, 120, 3, 0.25, 1.5, "bfloat16", "forward_backward")
WHEN = datetime(2025, 5, 6, 7, 8, 9, 500000, tzinfo=UTC)
ROUND_TRIPS = [
    (lathe.TensorData([1, 2, 3, 4, 5, 6], "int64", [2, 3]), wire.tensor_to_proto, wire.tensor_from_proto),
    (lathe.TensorData(np.array([0.5, -1.25], np.float32), "float32"), wire.tensor_to_proto, wire.tensor_from_proto),
    (lathe.TensorData([7, -8], "int32"), wire.tensor_to_proto, wire.tensor_from_proto),
    (lathe.ModelInput([lathe.EncodedTextChunk([1, 2]), lathe.EncodedTextChunk([3])]),
     wire.model_input_to_proto, wire.model_input_from_proto),
    (next_token_datum([5, 6, 7, 8]), wire.datum_to_proto, wire.datum_from_proto),
    (lathe.LoraConfig(), wire.lora_config_to_proto, wire.lora_config_from_proto),
    (lathe.LoraConfig(rank=4, seed=0, train_mlp=False, train_attn=True, train_unembed=False, alpha=8.0),
     wire.lora_config_to_proto, wire.lora_config_from_proto),
    (lathe.AdamParams(3e-4, 0.8, 0.99, 1e-8, 0.01, 1.0), wire.adam_params_to_proto, wire.adam_params_from_proto),
    (RECEIPT, wire.receipt_to_proto, wire.receipt_from_proto),
    (lathe.GetInfoResponse("m:train:0", lathe.ModelData(model_name=BASE, tokenizer_id="tok"),
                           lathe.LoraConfig(rank=16, seed=2), 4096),
     info_wire.get_info_to_proto, info_wire.get_info_from_proto),
    (lathe.GetServerCapabilitiesResponse([lathe.SupportedModel("a", 1), lathe.SupportedModel("b", 2)]),
     info_wire.capabilities_to_proto, info_wire.capabilities_from_proto),
    (lathe.Checkpoint("weights/x", "training", "tinker://r/weights/x", WHEN, 123, WHEN),
     info_wire.checkpoint_to_proto, info_wire.checkpoint_from_proto),
    (lathe.TrainingRun("r", BASE, lathe.LoraConfig(rank=2), WHEN, WHEN, {"k": "v"},
                       lathe.Checkpoint.from_tinker_path("tinker://r/weights/a"),
                       lathe.Checkpoint.from_tinker_path("tinker://r/sampler_weights/b")),
     info_wire.training_run_to_proto, info_wire.training_run_from_proto),
]


@pytest.mark.parametrize(("value", "to_proto", "from_proto"), ROUND_TRIPS,
                         ids=[type(v).__name__ for v, _, _ in ROUND_TRIPS])
def test_wire_round_trips(value: object, to_proto: Callable[[Any], Message], from_proto: Callable[[Any], object]
                          ) -> None:
    msg = to_proto(value)
    back = from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back == value


def test_optional_lora_fields_stay_unset() -> None:
    msg = wire.lora_config_to_proto(lathe.LoraConfig(rank=4))
    assert not msg.HasField("seed") and not msg.HasField("alpha")
    assert wire.lora_config_to_proto(lathe.LoraConfig(seed=0)).HasField("seed")


RESULTS = [
    lathe.ForwardBackwardOutput("ArrayRecord", [{"logprobs": lathe.TensorData([-0.5, -2.0], "float32", [2])}],
                                {"loss:sum": 2.5}, RECEIPT),
    lathe.OptimStepResponse({"grad_norm:mean": 0.5}, RECEIPT),
    lathe.SaveWeightsResponse("tinker://m/weights/a", RECEIPT),
    lathe.SaveWeightsForSamplerResponse("tinker://m/sampler_weights/a", None),
    lathe.LoadWeightsResponse("tinker://m/weights/a", "m", RECEIPT),
    lathe.CreateModelResponse("s:train:0"),
]


@pytest.mark.parametrize("value", RESULTS, ids=[type(v).__name__ for v in RESULTS])
def test_future_results_round_trip(value: object) -> None:
    res = pb.FutureResult.FromString(wire.result_to_proto(value, "req-9").SerializeToString())
    assert res.done and res.request_id == "req-9"
    assert wire.result_from_proto(res, type(value)) == value


def test_result_of_the_wrong_kind_is_an_internal_error() -> None:
    res = wire.result_to_proto(lathe.OptimStepResponse({}), "req-3")
    with pytest.raises(lathe.Internal, match="'optim_step' result; expected 'forward_backward'"):
        wire.result_from_proto(res, lathe.ForwardBackwardOutput)


def test_tensor_bytes_are_little_endian_raw_values() -> None:
    msg = wire.tensor_to_proto(lathe.TensorData([1, 256], "int32"))
    assert msg.data == b"\x01\x00\x00\x00\x00\x01\x00\x00" and list(msg.shape) == [2]
    with pytest.raises(lathe.InvalidArgument, match="7 bytes"):
        wire.tensor_from_proto(pb.Tensor(data=b"\x00" * 7, dtype="float32"))


def test_datum_converts_lists_by_key_like_tinker() -> None:
    d = lathe.Datum(model_input=lathe.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2.0, 3.0], "weights": [0, 1], "advantages": [True, False],
                                    "mask": [[1, 0], [0, 1]], "scale": [0.5, 2]})
    got = {k: (v.dtype, v.shape) for k, v in d.loss_fn_inputs.items()}
    assert got == {"target_tokens": ("int64", [2]), "weights": ("float32", [2]), "advantages": ("float32", [2]),
                   "mask": ("int64", [2, 2]), "scale": ("float32", [2])}
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3]
    assert d.loss_fn_inputs["mask"].to_numpy().tolist() == [[1, 0], [0, 1]]


def test_datum_converts_numpy_arrays_by_kind() -> None:
    d = lathe.Datum(model_input=lathe.ModelInput.from_ints([1]),
                    loss_fn_inputs={"target_tokens": np.array([[4, 5]], np.int32),
                                    "weights": np.array([0.25, 1.0]), "flags": np.array([True])})
    t = d.loss_fn_inputs["target_tokens"]
    assert (t.dtype, t.shape, t.to_numpy().dtype) == ("int64", [1, 2], np.int64)
    assert d.loss_fn_inputs["weights"].to_numpy().dtype == np.float32
    assert d.loss_fn_inputs["flags"].dtype == "int64"


def test_datum_converts_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    d = lathe.Datum(model_input=lathe.ModelInput.from_ints([1]),
                    loss_fn_inputs={"target_tokens": torch.tensor([[3, 4, 5]], dtype=torch.int32),
                                    "weights": torch.tensor([0.5, 1.0], dtype=torch.bfloat16, requires_grad=True)})
    t, w = d.loss_fn_inputs["target_tokens"], d.loss_fn_inputs["weights"]
    assert (t.dtype, t.shape, t.tolist()) == ("int64", [1, 3], [[3, 4, 5]])
    assert (w.dtype, w.tolist()) == ("float32", [0.5, 1.0])
    back = t.to_torch()
    assert back.dtype == torch.int64 and back.shape == (1, 3)
    assert lathe.TensorData.from_torch(back) == t


def test_bad_loss_inputs_are_refused_where_they_are_built() -> None:
    mi = lathe.ModelInput.from_ints([1])
    with pytest.raises(ValueError, match="rectangular"):
        lathe.Datum(model_input=mi, loss_fn_inputs={"weights": [[1.0], [1.0, 2.0]]})
    with pytest.raises(TypeError, match=r"loss_fn_inputs\['weights'\] is a str"):
        lathe.Datum(model_input=mi, loss_fn_inputs={"weights": "1.0"})
    with pytest.raises(ValueError, match="holds 6 values, but data has 5"):
        lathe.TensorData([1, 2, 3, 4, 5], "int64", [2, 3])
    with pytest.raises(ValueError, match="dtype = 'float64'"):
        lathe.TensorData([1.0], "float64")  # type: ignore[arg-type]


def test_model_input_helpers() -> None:
    mi = lathe.ModelInput.from_ints([1, 2]).append_int(3).append(lathe.EncodedTextChunk([4, 5]))
    assert mi.to_ints() == [1, 2, 3, 4, 5] and mi.length == 5 and len(mi.chunks) == 3
    assert lathe.ModelInput.empty().length == 0


def test_tinker_paths_parse() -> None:
    p = lathe.ParsedCheckpointTinkerPath.from_tinker_path("tinker://s:train:0/sampler_weights/final")
    assert (p.training_run_id, p.checkpoint_type, p.checkpoint_id) == ("s:train:0", "sampler", "sampler_weights/final")
    for bad in ("s/weights/x", "tinker://s/other/x", "tinker://s/weights/x/y", "tinker:///weights/x"):
        with pytest.raises(ValueError, match="invalid tinker path"):
            lathe.ParsedCheckpointTinkerPath.from_tinker_path(bad)


# ---------- clients against the fake gateway ----------


def test_session_is_lazy_and_every_call_carries_the_api_key(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    assert gw.calls == []
    tc = sc.create_lora_training_client(BASE, rank=8, seed=5, train_unembed=False, user_metadata={"renderer": "r"})
    tc2 = sc.create_lora_training_client(BASE)
    assert [c[0] for c in gw.calls[:2]] == ["CreateSession", "CreateModel"]
    assert len(gw.calls_of("CreateSession")) == 1
    first = gw.calls_of("CreateModel")[0]
    assert first.session_id == "sess-1" and first.base_model == BASE and dict(first.user_metadata) == {"renderer": "r"}
    assert wire.lora_config_from_proto(first.lora_config) == lathe.LoraConfig(rank=8, seed=5, train_unembed=False)
    assert (tc.model_id, tc2.model_id) == ("sess-1:train:0", "sess-1:train:1")
    info = tc.get_info()
    assert (info.model_id, info.model_name, info.lora_rank, info.max_context_length) == (tc.model_id, BASE, 8, 2048)
    assert [r.model_id for r in gw.calls_of("GetInfo")] == [tc.model_id, tc2.model_id]
    assert {meta.get("x-api-key") for _, _, meta in gw.calls} == {KEY}


def test_ops_get_seq_ids_1_2_3_and_typed_results(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    futs = [tc.forward_backward([next_token_datum([1, 2, 3]), next_token_datum([4, 5])], "cross_entropy", {"beta": 1}),
            tc.optim_step(lathe.AdamParams(learning_rate=0.5)),
            tc.save_state("s", ttl_seconds=60),
            tc.save_weights_for_sampler("w"),
            tc.load_state("tinker://x/weights/s"),
            tc.load_state_with_optimizer("tinker://x/weights/s"),
            tc.forward([next_token_datum([7, 8])])]
    fb, opt, save, sampler, load, load_opt, fwd = (f.result(timeout=10) for f in futs)
    submitted = [(name, req.seq_id) for name, req, _ in gw.calls if hasattr(req, "seq_id")]
    assert submitted == [("ForwardBackward", 1), ("OptimStep", 2), ("Save", 3), ("Save", 4), ("Load", 5),
                         ("Load", 6), ("ForwardBackward", 7)]
    assert [o["logprobs"].tolist() for o in fb.loss_fn_outputs] == [[-2.0, -3.0], [-5.0]]
    assert fb.metrics == {"loss:sum": 1.0} and fb.receipt.seq_id == 1 and fb.receipt.op == "ForwardBackward"
    assert opt.metrics == {"lr": 0.5} and opt.receipt.seq_id == 2
    assert save == lathe.SaveWeightsResponse(f"tinker://{tc.model_id}/weights/s", save.receipt)
    assert sampler.path == f"tinker://{tc.model_id}/sampler_weights/w"
    assert (load.path, load.model_id) == ("tinker://x/weights/s", tc.model_id)
    assert fwd.receipt.seq_id == 7 and load_opt.receipt.seq_id == 6
    fb_req, fwd_req = gw.calls_of("ForwardBackward")
    assert not fb_req.forward_only and fwd_req.forward_only and fwd_req.loss_fn == "cross_entropy"
    assert dict(fb_req.loss_fn_config) == {"beta": 1.0}
    assert wire.datum_from_proto(fb_req.data[0]) == next_token_datum([1, 2, 3])
    saves = gw.calls_of("Save")
    assert [(s.kind, s.name, s.ttl_seconds) for s in saves] == [("weights", "s", 60), ("sampler_weights", "w", 0)]
    assert [r.with_optimizer for r in gw.calls_of("Load")] == [False, True]
    assert all(f.request_id.startswith("req-") for f in futs)


def test_concurrent_callers_submit_in_seq_id_order(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    adam = lathe.AdamParams()

    def burst() -> list[lathe.APIFuture]:
        return [tc.optim_step(adam) for _ in range(10)]

    with ThreadPoolExecutor(4) as pool:
        futs = [f for fs in pool.map(lambda _: burst(), range(4)) for f in fs]
    assert sorted(f.result(timeout=10).receipt.seq_id for f in futs) == list(range(1, 41))
    assert [r.seq_id for r in gw.calls_of("OptimStep")] == list(range(1, 41))  # arrival order = seq order


def test_unavailable_submit_is_retried_with_the_same_seq_id(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    gw.inject["ForwardBackward"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    fb = tc.forward_backward([next_token_datum([1, 2])], "cross_entropy")
    opt = tc.optim_step(lathe.AdamParams())
    assert fb.result(timeout=10).receipt.seq_id == 1 and opt.result(timeout=10).receipt.seq_id == 2
    arrivals = [(name, req.seq_id) for name, req, _ in gw.calls if name in ("ForwardBackward", "OptimStep")]
    assert arrivals == [("ForwardBackward", 1)] * 3 + [("OptimStep", 2)]


def test_a_failed_submit_poisons_the_client(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    gw.inject["OptimStep"] = [grpc.StatusCode.INVALID_ARGUMENT]
    first = tc.forward_backward([next_token_datum([1, 2])], "cross_entropy")
    bad = tc.optim_step(lathe.AdamParams())
    later = tc.save_state("after")
    assert first.result(timeout=10).receipt.seq_id == 1
    with pytest.raises(lathe.InvalidArgument, match="injected OptimStep failure"):
        bad.result(timeout=10)
    with pytest.raises(lathe.FailedPrecondition, match="seq_id 3 was not submitted because seq_id 2 failed"):
        later.result(timeout=10)
    with pytest.raises(lathe.InvalidArgument):
        _ = bad.request_id
    assert gw.calls_of("Save") == []


def test_futures_long_poll_and_cache(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    gw.delay_s = 0.6
    fut = tc.optim_step(lathe.AdamParams())
    assert not fut.done()
    assert fut.result(timeout=10).receipt.seq_id == 1
    polls = [r for r in gw.calls_of("RetrieveFuture") if r.request_id == fut.request_id]
    assert {r.timeout_s for r in polls} == {30.0}
    assert 3 <= len(polls) <= 6  # each poll was held ~hold_s by the server: no busy loop
    assert fut.result() is fut.result()
    assert len(gw.calls_of("RetrieveFuture")) == len(polls) + 1  # + the CreateModel future's poll


def test_a_lost_poll_is_retried(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    gw.inject["RetrieveFuture"] = [grpc.StatusCode.UNAVAILABLE]
    assert tc.save_state("s").result(timeout=10).path.endswith("/weights/s")


def test_waiting_less_never_cancels_the_operation(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    tc = sc.create_lora_training_client(BASE)
    gw.delay_s = math.inf
    fut = tc.optim_step(lathe.AdamParams())
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        asyncio.run(fut.result_async(timeout=0.05))
    _, result = gw.futures[fut.request_id]
    gw.futures[fut.request_id] = (0.0, result)
    assert fut.result(timeout=10).receipt.seq_id == 1


@pytest.mark.parametrize(("code", "cls"), [("InvalidArgument", lathe.InvalidArgument),
                                           ("NotFound", lathe.NotFound),
                                           ("ResourceExhausted", lathe.ResourceExhausted),
                                           ("Unavailable", lathe.Unavailable),
                                           ("SomethingNew", lathe.Internal)])
def test_error_results_raise_their_class(sc: lathe.ServiceClient, gw: FakeGateway, code: str,
                                         cls: type[lathe.LatheError]) -> None:
    tc = sc.create_lora_training_client(BASE)
    gw.errors["ForwardBackward"] = pb.Error(code=code, message="weights has 3 values; target_tokens has 2",
                                            category="user")
    fut = tc.forward_backward([next_token_datum([1, 2])], "cross_entropy")
    with pytest.raises(cls, match="weights has 3 values") as e:
        fut.result(timeout=10)
    assert type(e.value) is cls
    with pytest.raises(cls):
        asyncio.run(fut.result_async())  # the cached error, also for async callers


def test_failed_calls_raise_their_class(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    gw.errors["CreateModel"] = pb.Error(code="InvalidArgument", message="lora_config.rank = 0 is outside [1, 256]")
    with pytest.raises(lathe.InvalidArgument, match="rank = 0"):
        sc.create_lora_training_client(BASE, rank=0)
    gw.inject["CreateModelFromState"] = [grpc.StatusCode.PERMISSION_DENIED]
    with pytest.raises(lathe.PermissionDenied, match="injected"):
        sc.create_training_client_from_state("tinker://other/weights/x")
    with pytest.raises(lathe.NotFound, match="unknown model_id 'nope'"):
        sc.create_rest_client().get_training_run("nope").result(timeout=10)
    gw.inject["GetServerCapabilities"] = [grpc.StatusCode.UNAVAILABLE] * 1000
    with pytest.raises(lathe.Unavailable):  # retried only within the policy's budget
        sc.get_server_capabilities()


def test_async_api(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    async def main() -> None:
        tc = await sc.create_lora_training_client_async(BASE, rank=4)
        fb = await tc.forward_backward_async([next_token_datum([1, 2, 3])], "cross_entropy")
        opt = await tc.optim_step_async(lathe.AdamParams())
        assert isinstance(fb, lathe.APIFuture)
        out, step = await asyncio.gather(fb, opt.result_async(timeout=10))
        assert out.metrics["loss:sum"] == 1.0 and step.receipt.seq_id == 2
        saved = await (await tc.save_state_async("a")).result_async()
        assert (await tc.get_info_async()).model_id == tc.model_id
        tc2 = await sc.create_training_client_from_state_with_optimizer_async(saved.path, user_metadata={"k": "v"})
        assert (await sc.get_server_capabilities_async()).supported_models[0].model_name == BASE
        return tc2

    tc2 = asyncio.run(main())
    req = gw.calls_of("CreateModelFromState")[0]
    assert (req.path, req.with_optimizer, dict(req.user_metadata)) == ("tinker://sess-1:train:0/weights/a", True,
                                                                      {"k": "v"})
    assert tc2.model_id == "sess-1:train:1"


def test_rest_client(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    rest = sc.create_rest_client()
    runs = rest.list_training_runs(limit=2, offset=4).result(timeout=10)
    assert [r.training_run_id for r in runs.training_runs] == ["sess-1:train:4", "sess-1:train:5"]
    assert runs.cursor == lathe.Cursor(offset=4, limit=2, total_count=50)
    run = rest.get_training_run_by_tinker_path("tinker://sess-1:train:3/weights/a").result(timeout=10)
    assert (run.training_run_id, run.user_metadata, run.lora_rank) == ("sess-1:train:3", {"renderer_name": "x"}, 8)
    assert run.last_checkpoint == lathe.Checkpoint("weights/a", "training", "tinker://sess-1:train:3/weights/a")
    assert run.last_sampler_checkpoint is None and run.created_at == datetime(2025, 1, 2, tzinfo=UTC)
    ckpts = rest.list_checkpoints("sess-1:train:0").result(timeout=10)
    assert ckpts.cursor is None and [c.checkpoint_id for c in ckpts.checkpoints] == ["weights/c0", "weights/c1",
                                                                                    "weights/c2"]
    assert ckpts.checkpoints[2].time == datetime.fromtimestamp(1002, UTC) and ckpts.checkpoints[2].expires_at is None
    mine = rest.list_user_checkpoints(limit=3, offset=6).result(timeout=10)
    assert mine.cursor == lathe.Cursor(offset=6, limit=3, total_count=9)
    assert rest.delete_checkpoint("sess-1:train:0", "weights/c1").result(timeout=10) is None
    assert rest.delete_checkpoint_from_tinker_path("tinker://r/sampler_weights/z").result(timeout=10) is None
    assert [r.tinker_path for r in gw.calls_of("DeleteCheckpoint")] == ["tinker://sess-1:train:0/weights/c1",
                                                                        "tinker://r/sampler_weights/z"]
    listed = gw.calls_of("ListCheckpoints")
    assert [(r.training_run_id, r.limit, r.offset) for r in listed] == [("sess-1:train:0", 0, 0), ("", 3, 6)]
    assert rest.list_training_runs().request_id is None  # a plain query has no server-side future


def test_environment_is_the_fallback(fake: tuple[FakeGateway, str], monkeypatch: pytest.MonkeyPatch) -> None:
    gw, address = fake
    monkeypatch.setenv("LATHE_BASE_URL", f"grpc://{address}/")
    monkeypatch.setenv("LATHE_API_KEY", "tml-from-env")
    with lathe.ServiceClient() as sc:
        sc.get_server_capabilities()
    with lathe.ServiceClient(address, "tml-arg") as sc:
        sc.get_server_capabilities()
    assert [meta["x-api-key"] for _, _, meta in gw.calls] == ["tml-from-env", "tml-arg"]


@pytest.mark.parametrize(("url", "target"), [("127.0.0.1:8500", "127.0.0.1:8500"), ("grpc://h:1/", "h:1"),
                                             (" localhost:9 ", "localhost:9")])
def test_base_url_forms(url: str, target: str) -> None:
    assert service_client.grpc_target(url) == target


@pytest.mark.parametrize("url", ["http://127.0.0.1:8500", "grpc://", "h:1/api/v1", ""])
def test_bad_base_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="not a gateway address"):
        service_client.grpc_target(url)


def test_heartbeat_keeps_the_session(fake: tuple[FakeGateway, str], monkeypatch: pytest.MonkeyPatch) -> None:
    gw, address = fake
    monkeypatch.setattr(service_client, "HEARTBEAT_S", 0.05)
    with lathe.ServiceClient(address, KEY) as sc:
        sc.create_lora_training_client(BASE)
        deadline = time.monotonic() + 5
        while len(gw.calls_of("Heartbeat")) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert {r.session_id for r in gw.calls_of("Heartbeat")} == {"sess-1"}
    beats = len(gw.calls_of("Heartbeat"))
    time.sleep(0.2)
    assert len(gw.calls_of("Heartbeat")) == beats  # closing stopped it


def test_close_cancels_what_is_in_flight(fake: tuple[FakeGateway, str]) -> None:
    gw, address = fake
    sc = lathe.ServiceClient(address, KEY)
    tc = sc.create_lora_training_client(BASE)
    gw.delay_s = math.inf
    fut = tc.optim_step(lathe.AdamParams())
    sc.close()
    sc.close()
    with pytest.raises(CancelledError):
        fut.result(timeout=10)
    with pytest.raises(lathe.FailedPrecondition, match="closed"):
        tc.optim_step(lathe.AdamParams())


def test_rest_client_constructed_on_its_own_like_tinkers(fake: tuple[FakeGateway, str]) -> None:
    """``RestClient(base_url=..., api_key=...)`` (what tinker 0.38 recommends) and the ``_async`` twins."""
    gw, address = fake
    rest = lathe.RestClient(base_url=address, api_key="tml-own")
    try:
        assert rest.get_training_run("sess-1:train:2", access_scope="accessible").result(timeout=10).lora_rank == 8

        async def main() -> tuple[lathe.TrainingRunsResponse, lathe.TrainingRun, None]:
            return (await rest.list_training_runs_async(limit=1),
                    await rest.get_training_run_by_tinker_path_async("tinker://sess-1:train:3/weights/a"),
                    await rest.delete_checkpoint_async("sess-1:train:0", "weights/c1"))

        runs, run, deleted = asyncio.run(main())
        assert [r.training_run_id for r in runs.training_runs] == ["sess-1:train:0"]
        assert run.training_run_id == "sess-1:train:3" and deleted is None
        with pytest.raises(lathe.InvalidArgument, match="access_scope"):
            rest.list_training_runs(access_scope="everyone")
    finally:
        rest.close()
    assert {meta["x-api-key"] for _, _, meta in gw.calls} == {"tml-own"}
    with pytest.raises(lathe.FailedPrecondition, match="closed"):
        rest.list_training_runs()


def test_tinker_spellings_of_optimizer_and_sampling(sc: lathe.ServiceClient, gw: FakeGateway) -> None:
    import tinker

    tc = sc.create_lora_training_client(BASE, rank=4, optimizer=lathe.AdamOptimizerConfig())
    sc.create_lora_training_client(BASE, rank=4, optimizer=tinker.types.AdamOptimizerConfig())
    sc.create_lora_training_client(BASE, rank=4, optimizer=tinker.types.DimuonOptimizerConfig())
    with pytest.raises(lathe.InvalidArgument, match="Lathe trains with adamw or dimuon"):
        sc.create_lora_training_client(BASE, optimizer=SimpleNamespace(type="sgd"))
    assert tc.optim_step(lathe.AdamParams(learning_rate=0.5)).result(timeout=10).metrics["lr"] == 0.5
    assert tc.optim_step(adam_params=lathe.AdamParams(learning_rate=0.25)).result(timeout=10).metrics["lr"] == 0.25
    with pytest.raises(lathe.InvalidArgument, match="not both"):
        tc.optim_step(lathe.AdamParams(), adam_params=lathe.AdamParams())
    with pytest.raises(lathe.InvalidArgument, match="pass AdamParams or DimuonParams"):
        tc.optim_step(tinker.types.DimuonParams(learning_rate=0.1))
    with pytest.raises(lathe.InvalidArgument, match=r"dimuon_params.beta1 = 1.0 must be in \[0, 1\)"):
        tc.optim_step(lathe.DimuonParams(learning_rate=0.1, beta1=1.0))
    with pytest.raises(lathe.PermissionDenied, match="weights_access_token"):
        tc.load_state("tinker://sess-1:train:0/weights/a", weights_access_token="tok")
    with pytest.raises(lathe.InvalidArgument, match="trained on 'fake/base'"):
        sc.create_training_client_from_state("tinker://sess-1:train:0/weights/a", base_model="other/model")
    assert sc.create_training_client_from_state("tinker://sess-1:train:0/weights/a", base_model=BASE).model_id
    policy = RetryPolicy(first_s=0.01, max_s=0.02, budget_s=1.0)
    sampler = tc.create_sampling_client("tinker://sess-1:train:0/sampler_weights/s", retry_config=policy)
    assert (sampler.model_path, sampler.get_base_model(), sampler._retry) == (
        "tinker://sess-1:train:0/sampler_weights/s", BASE, policy)
    with pytest.raises(lathe.NotFound, match="downloads nothing"):
        tc.get_tokenizer()  # the fake's base model exists nowhere on this machine


def test_get_tokenizer_reads_the_base_models_own_files(sc: lathe.ServiceClient, tiny_dir: Path, model_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A local model directory (what the cookbook passes) or a built-in name, from the catalog's cache."""
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode("def clamp(x):").ids
    by_dir = sc.create_sampling_client(base_model=str(tiny_dir)).get_tokenizer()
    assert by_dir.encode("def clamp(x):", add_special_tokens=False) == expected
    monkeypatch.setenv("LATHE_CACHE", str(model_cache))
    by_name = sc.create_sampling_client(base_model="lathe/tiny-llama").get_tokenizer()
    assert by_name.encode("def clamp(x):", add_special_tokens=False) == expected
    assert by_name.decode(expected) == "def clamp(x):"


def test_the_one_backoff_doubles_to_its_cap_and_stops_at_its_budget() -> None:
    """Every retry loop's pauses (the SDK's, the gateway's, the checkpoints client's): first_s, doubling up to
    max_s, while the try after the pause would start within budget_s of the backoff's making."""
    from lathe.backoff import Backoff

    now = [100.0]
    backoff = Backoff(0.1, 0.4, 1.0, clock=lambda: now[0])
    taken = []
    while (pause := backoff.next()) is not None:
        taken.append(pause)
        now[0] += pause
    assert taken == [0.1, 0.2, 0.4] and now[0] == pytest.approx(100.7)  # one more 0.4 would start at 101.1
    assert Backoff(0.1, 0.4, 0.0, clock=lambda: 0.0).next() is None  # no budget: never again
    with pytest.raises(ValueError, match="0 < first_s <= max_s and budget_s >= 0"):
        Backoff(0.5, 0.1, 1.0)
