"""An in-process fake ``lathe.v1.Gateway`` for the SDK's tests (tests/test_sdk.py): just enough of the gateway
to record every call and answer it at once with canned results."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import grpc
import numpy as np
from google.protobuf.message import Message

import lathe
from lathe import info_wire, wire
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

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
