"""The Tinker HTTP door at the protocol level: its protobuf schema and codecs against the tinker SDK's own,
and raw HTTP against real processes for ordering, long-polls and bad input (status, body, no state change)."""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as sdk_pb

from lathe.errors import InvalidArgument
from lathe.gateway.tinker_proto import (
    forward_backward_from_proto,
    forward_backward_output_to_proto,
    parse_forward_backward,
    sample_response_to_proto,
)
from lathe.stack import Stack
from lathe.types import TensorData
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import tinker_public_pb2 as ours
from lathe.wire import tensor_to_proto
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
PROTO = "application/x-protobuf"
WAIT_S = 60.0


# ---------- schema and codecs (no network) ----------


def _shape(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, list[tuple]]:
    """Every message's fields as (name, number, type, label, message type, proto3-optional, in a oneof)."""
    out: dict[str, list[tuple]] = {f"enum {e.name}": sorted((v.name, v.number) for v in e.value) for e in fd.enum_type}

    def walk(m: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        out[prefix + m.name] = sorted((f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1],
                                       f.proto3_optional, f.HasField("oneof_index")) for f in m.field)
        for n in m.nested_type:
            walk(n, f"{prefix}{m.name}.")

    for m in fd.message_type:
        walk(m, "")
    return out


def test_our_schema_is_the_sdks_on_the_wire() -> None:
    theirs, mine = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(theirs)
    ours.DESCRIPTOR.CopyToProto(mine)
    assert _shape(mine) == _shape(theirs)


def test_a_request_encoded_by_the_sdk_decodes_to_the_same_arrays() -> None:
    weights = torch.zeros(1, 40)
    weights[0, [3, 17]] = torch.tensor([0.5, 2.0])  # sparse enough for the SDK to send CSR
    sparse = types.TensorData.from_torch_sparse(weights)
    assert sparse.sparse_crow_indices is not None
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 41))),
                        loss_fn_inputs={"target_tokens": list(range(2, 42)), "weights": sparse})
    sdk_req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}), model_id="m", seq_id=4)
    req = forward_backward_from_proto(parse_forward_backward(
        request_conv.forward_backward_request_to_proto(sdk_req).SerializeToString()), 1 << 20, 1 << 20)
    assert (req.model_id, req.seq_id, req.loss_fn, dict(req.loss_fn_config)) == ("m", 4, "ppo",
                                                                                 {"clip_low_threshold": 0.7})
    assert list(req.data[0].model_input.chunks[0].tokens) == list(range(1, 41))
    w = req.data[0].loss_fn_inputs["weights"]
    assert (w.dtype, list(w.shape)) == ("float32", [1, 40])
    assert np.array_equal(np.frombuffer(w.data, "<f4"), weights.numpy().ravel())
    t = req.data[0].loss_fn_inputs["target_tokens"]
    assert t.dtype == "int64" and np.frombuffer(t.data, "<i8").tolist() == list(range(2, 42))


def test_text_loss_config_and_non_text_chunks_are_refused_by_name() -> None:
    msg = ours.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="ppo")
    msg.loss_fn_config_v2["clip_low_threshold"].text = "low"
    with pytest.raises(InvalidArgument, match=r"loss_fn_config\['clip_low_threshold'\]"):
        forward_backward_from_proto(msg, 1 << 20, 1 << 20)
    msg = ours.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().image.data = b"png"
    with pytest.raises(InvalidArgument, match=r"data\[0\]\.model_input\[0\] is a image chunk"):
        forward_backward_from_proto(msg, 1 << 20, 1 << 20)


_TARGET_RUNS = [types.PromptProvenanceSpan(sequence_id="r:0", offset=1, length=2),
                types.SampledProvenanceSpan(sequence_id="r:0", length=2)]


@pytest.mark.parametrize(("input_runs", "error"), [
    (None, r"data\[0\] has no provenance"),
    ([types.SampledProvenanceSpan(sequence_id="r:0", length=3)],
     r"data\[0\]\.model_input_spans covers 3 positions but the field has 4"),
    ([types.PromptProvenanceSpan(sequence_id="r:0", length=2),
      types.SampledProvenanceSpan(sequence_id="r:0", length=2)], None),
])
def test_stable_reinforce_datums_must_name_their_sampled_sequences(input_runs: list | None, error: str | None) -> None:
    """The door checks that provenance runs tile the input and the targets; other losses do not need them."""
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]), loss_fn_inputs={
        "target_tokens": [6, 7, 8, 9], "logprobs": [0.0, 0.0, -1.0, -2.0], "advantages": [0.0, 0.0, 1.0, 1.0]},
        model_input_spans=input_runs, loss_fn_input_spans=input_runs and _TARGET_RUNS)
    for loss_fn in ("stable_reinforce", "importance_sampling"):
        body = request_conv.forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn), model_id="m",
            seq_id=1)).SerializeToString()
        if error and loss_fn == "stable_reinforce":
            with pytest.raises(InvalidArgument, match=error):
                forward_backward_from_proto(parse_forward_backward(body), 1 << 20, 1 << 20)
        else:
            decoded = forward_backward_from_proto(parse_forward_backward(body), 1 << 20, 1 << 20).data[0]
            assert decoded.loss_fn_inputs.keys() == datum.loss_fn_inputs.keys()


def _tensor(values: np.ndarray) -> pb.Tensor:
    return tensor_to_proto(TensorData.from_numpy(values))


def _f32(values: list[float]) -> pb.Tensor:
    return pb.Tensor(data=np.asarray(values, "<f4").tobytes(), dtype="float32", shape=[len(values)])


def test_outputs_read_back_with_the_sdks_own_decoders() -> None:
    lps = [[-1.0, -2.5], [-0.25], [-3.0, -0.5, -1.5]]
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 8.75},
                                   loss_fn_outputs=[pb.LossFnOutput(tensors={"logprobs": _f32(x)}) for x in lps])
    got = response_conv.deserialize_forward_backward_output(forward_backward_output_to_proto(out))
    assert got.metrics == {"loss:sum": 8.75}
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == lps
    assert [o["logprobs"].shape for o in got.loss_fn_outputs] == [[2], [1], [3]]

    top = [pb.TopkLogprobs(token_ids=[i, i + 1], logprobs=[-0.5, -1.0]) for i in range(3)]
    target = np.asarray([[-0.5, 0.0], [0.0, 0.0], [-1.5, -2.5]], np.float32)
    alt_tokens, alt_lps = np.asarray([[4, 4], [5, 6], [7, 8]]), np.asarray([[-1, -1], [-2, -3], [-4, -5]], np.float32)
    sample = pb.SampleOutput(
        sequences=[pb.SampledSequence(tokens=[7, 8], logprobs=[-0.5, -1.25], stop_reason="length",
                                      topk_logprobs=top[:2]),
                   pb.SampledSequence(tokens=[9], logprobs=[-2.0], stop_reason="stop")],
        prompt_logprobs=[float("nan"), float("nan"), -0.75, -2.25],  # prompt_logprobs_last_n = 2
        topk_prompt_logprobs=[pb.TopkLogprobs()] * 2 + top[1:],
        target_prompt_logprobs=_tensor(target),
        prompt_alt_tokens=pb.PromptAltTokens(tokens=_tensor(alt_tokens), logprobs=_tensor(alt_lps)))
    res = response_conv.deserialize_sample_response(sample_response_to_proto(sample))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences] == [
        ([7, 8], [-0.5, -1.25], "length"), ([9], [-2.0], "stop")]
    assert res.sequences[0].topk_logprobs == [[(0, -0.5), (1, -1.0)], [(1, -0.5), (2, -1.0)]]
    assert res.sequences[1].topk_logprobs is None
    assert res.prompt_logprobs == [None, None, -0.75, -2.25]
    assert res.topk_prompt_logprobs == [None, None, [(1, -0.5), (2, -1.0)], [(2, -0.5), (3, -1.0)]]
    assert np.array_equal(res.target_prompt_logprobs.to_numpy(), target)
    assert np.array_equal(res.prompt_alt_tokens.tokens.to_numpy(), alt_tokens)
    assert np.array_equal(res.prompt_alt_tokens.logprobs.to_numpy(), alt_lps)
    # a sparse target request (cells [0, 0], [2, 0], [2, 1]) is answered in its own layout
    layout = ours.SparseCsr(crow_indices=np.asarray([0, 1, 1, 3], "<i8").tobytes(),
                            col_indices=np.asarray([0, 0, 1], "<i8").tobytes())
    sparse = response_conv.deserialize_sample_response(sample_response_to_proto(sample, layout)).target_prompt_logprobs
    assert (sparse.sparse_crow_indices, sparse.sparse_col_indices) == ([0, 1, 1, 3], [0, 0, 1])
    assert sparse.data == [-0.5, -1.5, -2.5] and np.array_equal(sparse.to_numpy(), target)


# ---------- raw HTTP against real processes ----------




class Api:
    """One tenant's raw HTTP view of the door."""

    def __init__(self, url: str, key: str | None) -> None:
        headers = {"X-API-Key": key} if key is not None else {}
        self.http = httpx.Client(base_url=f"{url}/api/v1", headers=headers, timeout=WAIT_S)

    def post(self, path: str, body: dict | None = None, **kw: object) -> httpx.Response:
        return self.http.post(path, json=body or {}, **kw)

    def ok(self, path: str, body: dict | None = None) -> dict:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    def result(self, request_id: str) -> httpx.Response:
        """The finished result of a future (bounded: WAIT_S)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            r = self.post("/retrieve_future", {"request_id": request_id, "allow_metadata_only": True})
            assert r.status_code == 200, r.text
            if PROTO in r.headers["content-type"] or r.json().get("type") != "try_again":
                return r
        raise TimeoutError(request_id)

    def model(self, seed: int = 1) -> str:
        session = self.ok("/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "raw"})["session_id"]
        fut = self.ok("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                        "lora_config": {"rank": 4, "seed": seed}})
        assert self.result(fut["request_id"]).json() == {"model_id": f"{session}:train:0"}
        return fut["model_id"]

    def forward_backward(self, model_id: str, seq_id: int, tokens: list[int], forward_only: bool = False
                         ) -> httpx.Response:
        datum = next_token_datum(tokens, types)
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="cross_entropy"), model_id=model_id, seq_id=seq_id)
        body = request_conv.forward_backward_request_to_proto(req)
        body.forward_only = forward_only
        return self.http.post("/forward_backward", content=body.SerializeToString(),
                              headers={"content-type": PROTO})


def _fb(r: httpx.Response) -> types.ForwardBackwardOutput:
    assert r.headers["content-type"] == PROTO, r.text
    return response_conv.deserialize_forward_backward_output(r.content)


TOKENS = [5, 17, 42, 9, 33, 120, 7, 88, 64]
ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def test_early_and_repeated_seq_ids_run_in_order_exactly_once(stack: Stack) -> None:
    api = Api(stack.http_url, "tml-order")
    late, ref = api.model(seed=3), api.model(seed=3)

    # seq 2 arrives first: it waits for seq 1, and a long-poll on it ends in try_again when asked to be short
    opt = api.ok("/optim_step", {"model_id": late, "seq_id": 2, "adam_params": ADAM})
    t0 = time.monotonic()
    held = api.post("/retrieve_future", {"request_id": opt["request_id"]}, headers={"x-stainless-read-timeout": "17"},
                    timeout=17.0)  # as the SDK sends it: the header names the client's own read timeout
    assert held.json() == {"type": "try_again", "request_id": opt["request_id"], "queue_state": "active",
                           "queue_state_reason": None}
    assert time.monotonic() - t0 >= 1.5  # it was held, and ended before the client's 17 s read timeout
    assert api.ok("/optim_step", {"model_id": late, "seq_id": 2, "adam_params": ADAM}) == opt  # a repeat
    fb = api.forward_backward(late, 1, TOKENS).json()
    assert api.forward_backward(late, 1, TOKENS).json() == fb  # a repeat
    fwd = api.forward_backward(late, 3, TOKENS, forward_only=True).json()

    ref_fb = api.forward_backward(ref, 1, TOKENS).json()
    api.ok("/optim_step", {"model_id": ref, "seq_id": 2, "adam_params": ADAM})
    ref_fwd = api.forward_backward(ref, 3, TOKENS, forward_only=True).json()

    assert api.result(opt["request_id"]).json()["metrics"]["step:max"] == 1.0  # applied once
    assert _fb(api.result(fb["request_id"])).metrics == _fb(api.result(ref_fb["request_id"])).metrics
    late_lp = _fb(api.result(fwd["request_id"])).loss_fn_outputs[0]["logprobs"].tolist()
    assert late_lp == _fb(api.result(ref_fwd["request_id"])).loss_fn_outputs[0]["logprobs"].tolist()


def _refused(r: httpx.Response, status: int, pattern: str) -> None:
    """A rejected call: the given status, a JSON body with the error and the user category, no retry."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["category"] == "user" and re.search(pattern, body["error"]), body
    assert r.headers.get("x-should-retry") == "false"


def test_bad_input_gets_the_status_and_body_the_sdk_expects_and_changes_nothing(stack: Stack) -> None:
    alice, bob = Api(stack.http_url, "tml-alice"), Api(stack.http_url, "tml-bob")
    model = alice.model()
    path = alice.result(alice.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "keep"})["request_id"]
                        ).json()["path"]
    session = model.split(":")[0]
    runs_before = {who: api.http.get("/training_runs").json() for who, api in (("a", alice), ("b", bob))}

    _refused(Api(stack.http_url, None).post("/client/config"), 401, "x-api-key")
    _refused(Api(stack.http_url, "dummy").post("/client/config"), 401, "tml-")
    _refused(alice.post("/forward_backward", {"model_id": model, "seq_id": 2}), 400, "application/x-protobuf")
    _refused(alice.http.post("/forward_backward", content=b"\xff\xff\xff", headers={"content-type": PROTO}), 400,
             "not a valid tinker_public.ForwardBackwardRequest")
    _refused(alice.post("/retrieve_future", {"request_id": "req-nope"}), 404, "request_id 'req-nope'")
    _refused(alice.post("/create_model", {"session_id": session, "model_seq_id": 7, "base_model": "no/such-model",
                                          "lora_config": {"rank": 4}}), 400, "base_model 'no/such-model'")
    _refused(alice.post("/create_model", {"session_id": session, "model_seq_id": 7}), 400, "base_model is required")
    _refused(alice.post("/optim_step", {"model_id": model, "seq_id": "two"}), 400, "seq_id must be an integer")
    _refused(alice.http.post("/create_session", content=b"{oops"), 400, "not valid JSON")
    _refused(alice.post("/no_such_endpoint"), 404, "/api/v1/no_such_endpoint")
    _refused(alice.post("/save_weights_for_sampler", {"model_id": model, "seq_id": 2, "kind": "live",
                                                      "sampling_session_seq_id": 0}), 400,
             "kind = 'live': a sampling client is 'snapshot' or 'inflight'")
    _refused(alice.post("/save_weights_for_sampler", {"model_id": model, "seq_id": 2, "kind": "inflight",
                                                      "path": "named"}), 400,
             "kind = 'inflight' publishes unnamed weights: drop path 'named'")
    _refused(bob.post("/get_info", {"model_id": model}), 404, "model_id")
    _refused(bob.forward_backward(model, 2, TOKENS), 404, "model_id")
    _refused(bob.post("/weights_info", {"tinker_path": path}), 404, "not found")
    _refused(bob.http.delete(f"/training_runs/{model}/checkpoints/weights/keep"), 404, "not found")
    bob_session = bob.ok("/create_session", {"user_metadata": {}})["session_id"]
    _refused(bob.post("/create_sampling_session", {"session_id": bob_session, "sampling_session_seq_id": 0,
                                                   "model_path": path}), 404, "not found")

    # nothing changed: the same runs and checkpoints, and alice's model still takes its next seq_id
    assert {who: api.http.get("/training_runs").json() for who, api in (("a", alice), ("b", bob))} == runs_before
    ckpts = alice.http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"]
    assert [c["tinker_path"] for c in ckpts] == [path]
    assert _fb(alice.result(alice.forward_backward(model, 2, TOKENS).json()["request_id"])).metrics["loss:sum"] > 0


def test_a_failed_operation_is_a_200_with_error_and_category(stack: Stack) -> None:
    api = Api(stack.http_url, "tml-fail")
    model = api.model()
    fut = api.forward_backward(model, 1, [1, 2, 3, 1000]).json()  # token 1000 is outside the vocabulary
    body = api.result(fut["request_id"]).json()
    assert body["category"] == "user" and "outside the vocabulary" in body["error"]


def test_a_finished_session_takes_no_new_models(stack: Stack) -> None:
    api = Api(stack.http_url, "tml-done")
    session = api.ok("/create_session", {"user_metadata": {}})["session_id"]
    assert api.ok(f"/sessions/{session}/finish", {"reason": {"type": "success"}, "detail": None}) == {}
    _refused(api.post("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                        "lora_config": {"rank": 4}}), 400, "has finished")


def test_healthz_answers_the_sdks_health_check(stack: Stack) -> None:
    import asyncio

    from tinker._client import AsyncTinker

    async def check() -> types.HealthResponse:
        async with AsyncTinker(base_url=stack.http_url, api_key="tml-health") as client:
            return await client.service.health_check()

    assert asyncio.run(check()).status == "ok"
    assert Api(stack.http_url, "tml-health").http.get("/healthz").json() == {"status": "ok"}
