"""Tenant isolation: a second tenant tries every read, write, list, load, sample, save, delete and future retrieval on
the first tenant's ids and paths, through both doors and directly against the internal services.

The stack here runs as deployed: API keys from a file (one given as its SHA-256 only), both public doors behind
TLS with a self-signed certificate made for the test, and the internal services behind the stack's secret.
Every attempt must fail, and fail exactly as the same attempt on an id that does not exist (same status, same
message once the ids are blanked): a refusal that differs would tell the intruder the id exists. Afterwards the
owner's run, checkpoints and sampler are as they were. The door clients: tests/secured_doors.py.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from tinker import types
from tinker.proto import request_conv

from lathe.runtime.internal_auth import METADATA_KEY
from lathe.stack import Stack, StackConfig
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from tests.helpers import next_token_datum, next_token_pb_datum
from tests.secured_doors import WAIT_S, Grpc, Secured

BASE = "lathe/tiny-llama"
OWNER_KEY, INTRUDER_KEY = "tml-owner-" + "a" * 24, "tml-intruder-" + "b" * 24
PROTO = "application/x-protobuf"
TOKENS = [5, 17, 42, 9, 33, 120, 7, 88]
HEXISH = re.compile(r"[0-9a-f]{4,}")  # the random parts of Lathe's ids
SAMPLING = pb.SamplingParams(max_tokens=2, temperature=1.0, top_p=1.0, seed=1)
LORA = pb.LoraConfig(rank=4, seed=3, train_attn=True, train_mlp=True, train_unembed=True)


def twin(victim: str) -> str:
    """An id of the same form as ``victim`` that names nothing (its random parts redrawn)."""
    return HEXISH.sub(lambda m: secrets.token_hex(len(m[0]))[:len(m[0])], victim)


def blank(message: str) -> str:
    return HEXISH.sub("<id>", message)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("secured")
    cert, key = _self_signed(folder)
    keys = folder / "api-keys"
    keys.write_text(f"# key -> tenant\n{OWNER_KEY}=owner\n"
                    f"sha256:{hashlib.sha256(INTRUDER_KEY.encode()).hexdigest()}=intruder\n")
    cfg = StackConfig(models=BASE, store_root=folder / "store", cache_root=model_cache, trainer_threads=1,
                      sampler_threads=1, api_keys_file=keys, tls_cert=cert, tls_key=key)
    with Stack(cfg) as stack:
        yield Secured(stack, cert.read_bytes(), cert)


def _datum() -> pb.Datum:
    return next_token_pb_datum(TOKENS)


@dataclass(slots=True)
class Owned:
    """What the owner has: ids and paths the intruder will try."""

    session_id: str
    model_id: str
    state_path: str
    sampler_path: str
    sampling_session_id: str
    fb_request: str
    sample_request: str
    logprobs: list[float]


def _forward(door: Grpc, model_id: str, seq: int) -> list[float]:
    res = door.done(door.call("ForwardBackward", pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq, data=[_datum()], loss_fn="cross_entropy", forward_only=True)),
        "forward_backward")
    logprobs = res.forward_backward.loss_fn_outputs[0].tensors["logprobs"]
    return np.frombuffer(logprobs.data, dtype=logprobs.dtype).tolist()


@pytest.fixture(scope="module")
def owned(secured: Secured) -> Owned:
    door = secured.grpc(OWNER_KEY)
    session = door.call("CreateSession", pb.CreateSessionRequest()).session_id
    model_id = door.done(door.call("CreateModel", pb.CreateModelRequest(
        session_id=session, base_model=BASE, lora_config=LORA)), "create_model"
    ).create_model.model_id
    fb = door.call("ForwardBackward", pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, data=[_datum()],
                                                                loss_fn="cross_entropy"))
    door.done(fb, "forward_backward")
    door.done(door.call("OptimStep", pb.OptimStepRequest(model_id=model_id, seq_id=2, adam_params=pb.AdamParams(
        learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8))), "optim_step")
    state = door.done(door.call("Save", pb.SaveRequest(model_id=model_id, seq_id=3, name="owner-state",
                                                       kind="weights")), "save").save.path
    sampler = door.done(door.call("Save", pb.SaveRequest(model_id=model_id, seq_id=4, name="owner-sampler",
                                                         kind="sampler_weights")), "save").save.path
    sampling = door.call("CreateSamplingSession", pb.CreateSamplingSessionRequest(
        session_id=session, model_path=sampler)).sampling_session_id
    sample = door.call("Sample", pb.SampleRequest(sampling_session_id=sampling, seq_id=1, prompt=TOKENS[:4],
                                                  num_samples=1, params=SAMPLING))
    door.done(sample, "sample")
    return Owned(session, model_id, state, sampler, sampling, fb.request_id, sample.request_id,
                 _forward(door, model_id, 5))


# ---------- the gRPC door ----------


GRPC_PROBES: dict[str, Callable[[Owned, Callable[[str], str], str], tuple[str, object]]] = {
    "get_info": lambda o, t, mine: ("GetInfo", pb.GetInfoRequest(model_id=t(o.model_id))),
    "forward_backward": lambda o, t, mine: ("ForwardBackward", pb.ForwardBackwardRequest(
        model_id=t(o.model_id), seq_id=6, data=[_datum()], loss_fn="cross_entropy")),
    "optim_step": lambda o, t, mine: ("OptimStep", pb.OptimStepRequest(
        model_id=t(o.model_id), seq_id=6, adam_params=pb.AdamParams(learning_rate=1.0, beta1=0.9, beta2=0.95,
                                                                    eps=1e-8))),
    "save": lambda o, t, mine: ("Save", pb.SaveRequest(model_id=t(o.model_id), seq_id=6, name="stolen",
                                                       kind="weights")),
    "load_into_theirs": lambda o, t, mine: ("Load", pb.LoadRequest(model_id=t(o.model_id), seq_id=6,
                                                                   path=t(o.state_path))),
    "load_from_theirs": lambda o, t, mine: ("CreateModelFromState", pb.CreateModelFromStateRequest(
        session_id=mine, path=t(o.state_path), with_optimizer=True)),
    "create_model_in_their_session": lambda o, t, mine: ("CreateModel", pb.CreateModelRequest(
        session_id=t(o.session_id), base_model=BASE, lora_config=LORA)),
    "heartbeat": lambda o, t, mine: ("Heartbeat", pb.HeartbeatRequest(session_id=t(o.session_id))),
    "retrieve_their_fb": lambda o, t, mine: ("RetrieveFuture", pb.RetrieveFutureRequest(
        request_id=t(o.fb_request))),
    "retrieve_their_sample": lambda o, t, mine: ("RetrieveFuture", pb.RetrieveFutureRequest(
        request_id=t(o.sample_request))),
    "get_run": lambda o, t, mine: ("GetTrainingRun", pb.GetTrainingRunRequest(training_run_id=t(o.model_id))),
    "list_their_checkpoints": lambda o, t, mine: ("ListCheckpoints", pb.ListRunCheckpointsRequest(
        training_run_id=t(o.model_id))),
    "delete_state": lambda o, t, mine: ("DeleteCheckpoint", pb.DeleteCheckpointRequest(tinker_path=t(o.state_path))),
    "delete_sampler": lambda o, t, mine: ("DeleteCheckpoint", pb.DeleteCheckpointRequest(
        tinker_path=t(o.sampler_path))),
    "sample_their_weights": lambda o, t, mine: ("CreateSamplingSession", pb.CreateSamplingSessionRequest(
        session_id=mine, model_path=t(o.sampler_path))),
    "sample_their_state": lambda o, t, mine: ("CreateSamplingSession", pb.CreateSamplingSessionRequest(
        session_id=mine, model_path=t(o.state_path))),
    "get_sampling_session": lambda o, t, mine: ("GetSamplingSession", pb.GetSamplingSessionRequest(
        sampling_session_id=t(o.sampling_session_id))),
    "join_their_sampling_session": lambda o, t, mine: ("JoinSamplingSession", pb.JoinSamplingSessionRequest(
        sampling_session_id=t(o.sampling_session_id))),
    "sample_in_their_session": lambda o, t, mine: ("Sample", pb.SampleRequest(
        sampling_session_id=t(o.sampling_session_id), seq_id=9, prompt=TOKENS[:4], num_samples=1,
        params=SAMPLING)),
}


@pytest.mark.parametrize("probe", list(GRPC_PROBES))
def test_grpc_door_refuses_the_other_tenant_as_if_the_id_did_not_exist(secured: Secured, owned: Owned,
                                                                       probe: str) -> None:
    door = secured.grpc(INTRUDER_KEY)
    mine = door.call("CreateSession", pb.CreateSessionRequest()).session_id
    theirs = door.outcome(*GRPC_PROBES[probe](owned, lambda s: s, mine))
    missing = door.outcome(*GRPC_PROBES[probe](owned, twin, mine))
    assert theirs[0] in ("NOT_FOUND", "NotFound"), theirs
    assert (theirs[0], blank(theirs[1])) == (missing[0], blank(missing[1]))


def test_grpc_listings_show_nothing_of_the_other_tenant(secured: Secured, owned: Owned) -> None:
    door = secured.grpc(INTRUDER_KEY)
    listed = [door.call("ListTrainingRuns", pb.ListTrainingRunsRequest(limit=100)),
              door.call("ListCheckpoints", pb.ListRunCheckpointsRequest(limit=100))]
    for res in listed:
        text = str(res)
        assert owned.model_id not in text and owned.session_id not in text and "owner-" not in text


# ---------- the Tinker HTTP door ----------


def _fb_body(model_id: str) -> bytes:
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[next_token_datum(TOKENS, types)], loss_fn="cross_entropy"), model_id=model_id, seq_id=7)
    return request_conv.forward_backward_request_to_proto(req).SerializeToString()


def _run_and_checkpoint(path: str) -> tuple[str, str]:
    run, _, checkpoint = path.removeprefix("tinker://").partition("/")
    return run, checkpoint


ADAM = {"learning_rate": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:4]}]}
HTTP_PROBES: dict[str, Callable[[Owned, Callable[[str], str], str], tuple[str, str, object]]] = {
    "get_info": lambda o, t, mine: ("POST", "/get_info", {"model_id": t(o.model_id)}),
    "forward_backward": lambda o, t, mine: ("PROTO", "/forward_backward", _fb_body(t(o.model_id))),
    "optim_step": lambda o, t, mine: ("POST", "/optim_step", {"model_id": t(o.model_id), "seq_id": 7,
                                                              "adam_params": ADAM}),
    "save_weights": lambda o, t, mine: ("POST", "/save_weights", {"model_id": t(o.model_id), "seq_id": 7,
                                                                  "path": "stolen"}),
    "save_for_sampler": lambda o, t, mine: ("POST", "/save_weights_for_sampler", {
        "model_id": t(o.model_id), "seq_id": 7, "path": "stolen"}),
    "load_into_theirs": lambda o, t, mine: ("POST", "/load_weights", {
        "model_id": t(o.model_id), "seq_id": 7, "path": t(o.state_path), "optimizer": False}),
    "load_from_theirs": lambda o, t, mine: ("POST", "/load_weights", {
        "session_id": mine, "model_seq_id": 1, "path": t(o.state_path), "optimizer": True}),
    "create_model_in_their_session": lambda o, t, mine: ("POST", "/create_model", {
        "session_id": t(o.session_id), "model_seq_id": 5, "base_model": BASE, "lora_config": {"rank": 4}}),
    "heartbeat": lambda o, t, mine: ("POST", "/session_heartbeat", {"session_id": t(o.session_id)}),
    "retrieve_their_fb": lambda o, t, mine: ("POST", "/retrieve_future", {"request_id": t(o.fb_request)}),
    "retrieve_their_sample": lambda o, t, mine: ("POST", "/retrieve_future", {"request_id": t(o.sample_request)}),
    "get_run": lambda o, t, mine: ("GET", f"/training_runs/{t(o.model_id)}", None),
    "list_their_checkpoints": lambda o, t, mine: ("GET", f"/training_runs/{t(o.model_id)}/checkpoints", None),
    "weights_info": lambda o, t, mine: ("POST", "/weights_info", {"tinker_path": t(o.state_path)}),
    "delete_state": lambda o, t, mine: (
        "DELETE", "/training_runs/{}/checkpoints/{}".format(*_run_and_checkpoint(t(o.state_path))), None),
    "delete_sampler": lambda o, t, mine: (
        "DELETE", "/training_runs/{}/checkpoints/{}".format(*_run_and_checkpoint(t(o.sampler_path))), None),
    "sample_their_weights": lambda o, t, mine: ("POST", "/create_sampling_session", {
        "session_id": mine, "sampling_session_seq_id": 3, "model_path": t(o.sampler_path)}),
    "get_sampler": lambda o, t, mine: ("GET", f"/samplers/{t(o.sampling_session_id)}", None),
    "sample_in_their_session": lambda o, t, mine: ("POST", "/asample", {
        "sampling_session_id": t(o.sampling_session_id), "seq_id": 9, "num_samples": 1, "prompt": PROMPT,
        "sampling_params": {"max_tokens": 2}}),
}


def _http_outcome(http: httpx.Client, method: str, path: str, body: object) -> tuple[int, str]:
    if method == "PROTO":
        r = http.post(path, content=body, headers={"content-type": PROTO})
    else:
        r = http.request("POST" if method == "POST" else method, path, json=body)
    if r.status_code == 200 and "request_id" in r.json() and path != "/retrieve_future":
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            r = http.post("/retrieve_future", json={"request_id": r.json()["request_id"]})
            if PROTO in r.headers.get("content-type", "") or r.json().get("type") != "try_again":
                break
    return r.status_code, r.text


@pytest.mark.parametrize("probe", list(HTTP_PROBES))
def test_http_door_refuses_the_other_tenant_as_if_the_id_did_not_exist(secured: Secured, owned: Owned,
                                                                       probe: str) -> None:
    with secured.http(INTRUDER_KEY) as http:
        mine = http.post("/create_session", json={"user_metadata": {}}).json()["session_id"]
        theirs = _http_outcome(http, *HTTP_PROBES[probe](owned, lambda s: s, mine))
        missing = _http_outcome(http, *HTTP_PROBES[probe](owned, twin, mine))
    refused = theirs[0] == 404 or (theirs[0] == 200 and '"error"' in theirs[1] and "not found" in theirs[1])
    assert refused, theirs
    assert (theirs[0], blank(theirs[1])) == (missing[0], blank(missing[1]))


def test_http_listings_show_nothing_of_the_other_tenant(secured: Secured, owned: Owned) -> None:
    with secured.http(INTRUDER_KEY) as http:
        for path in ("/training_runs", "/checkpoints"):
            r = http.get(path)
            assert r.status_code == 200
            assert owned.model_id not in r.text and owned.session_id not in r.text and "owner-" not in r.text


# ---------- keys and TLS at the doors ----------


def test_doors_take_only_configured_keys_and_only_tls(secured: Secured) -> None:
    for key in ("tml-unknown", INTRUDER_KEY.upper(), hashlib.sha256(INTRUDER_KEY.encode()).hexdigest()):
        with pytest.raises(grpc.RpcError) as e:
            secured.grpc(key).call("CreateSession", pb.CreateSessionRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with secured.http(key) as http:
            assert http.post("/create_session", json={"user_metadata": {}}).status_code == 401
    plain = grpc.insecure_channel(secured.stack.gateway)
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.GatewayStub(plain).CreateSession(pb.CreateSessionRequest(), metadata=(("x-api-key", OWNER_KEY),),
                                                 timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(secured.stack.http_url.replace("https://", "http://") + "/api/v1/get_server_capabilities",
                  timeout=5)


# ---------- the internal services ----------


def _internal_calls(owned: Owned) -> dict[str, Callable[[grpc.Channel, tuple], object]]:
    tenant = "owner"
    ref = cpb.CheckpointRef(tenant=tenant, path=owned.state_path)
    op = pb.TrainerOp(tenant=tenant, model_id=owned.model_id)
    return {
        "checkpoints.Get": lambda ch, md: cpb_grpc.CheckpointsStub(ch).Get(ref, metadata=md, timeout=WAIT_S),
        "checkpoints.List": lambda ch, md: cpb_grpc.CheckpointsStub(ch).List(
            cpb.ListCheckpointsRequest(tenant=tenant), metadata=md, timeout=WAIT_S),
        "checkpoints.Delete": lambda ch, md: cpb_grpc.CheckpointsStub(ch).Delete(ref, metadata=md, timeout=WAIT_S),
        "checkpoints.Put": lambda ch, md: cpb_grpc.CheckpointsStub(ch).Put(cpb.PutCheckpointRequest(
            tenant=tenant, run_id="x", kind="weights", name="planted", files={"a": b"b"}), metadata=md,
            timeout=WAIT_S),
        "checkpoints.GetStream": lambda ch, md: list(cpb_grpc.CheckpointsStub(ch).GetStream(
            ref, metadata=md, timeout=WAIT_S)),
        "trainer.Run": lambda ch, md: pb_grpc.TrainerStub(ch).Run(op, metadata=md, timeout=WAIT_S),
        "trainer.Capabilities": lambda ch, md: pb_grpc.TrainerStub(ch).Capabilities(
            pb.TrainerCapabilitiesRequest(), metadata=md, timeout=WAIT_S),
        "sampler.Sample": lambda ch, md: pb_grpc.SamplerStub(ch).Sample(pb.SampleRequest(
            tenant=tenant, base_model=BASE, model_path=owned.sampler_path, prompt=TOKENS[:4], num_samples=1,
            params=SAMPLING), metadata=md, timeout=WAIT_S),
    }


@pytest.mark.parametrize("call", ["checkpoints.Get", "checkpoints.List", "checkpoints.Delete", "checkpoints.Put",
                                  "checkpoints.GetStream", "trainer.Run", "trainer.Capabilities", "sampler.Sample"])
def test_internal_services_refuse_callers_without_the_stack_secret(secured: Secured, owned: Owned,
                                                                   call: str) -> None:
    fn = _internal_calls(owned)[call]
    with secured.internal(call.split(".")[0]) as channel:
        for md in ((), ((METADATA_KEY, "guess"),), ((METADATA_KEY, secured.stack.internal_token[:-1]),),
                   ((METADATA_KEY, secured.stack.internal_token + "x"),)):
            with pytest.raises(grpc.RpcError) as e:
                fn(channel, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (call, md, e.value)


def test_the_stack_secret_is_what_opens_them(secured: Secured, owned: Owned) -> None:
    """The same calls with the secret get through (so the refusals above are the secret's doing)."""
    with secured.internal("checkpoints") as channel:
        res = cpb_grpc.CheckpointsStub(channel).List(cpb.ListCheckpointsRequest(tenant="owner"), timeout=WAIT_S,
                                                     metadata=((METADATA_KEY, secured.stack.internal_token),))
        assert owned.state_path in {c.path for c in res.checkpoints}
    with secured.internal("trainer") as channel:
        pb_grpc.TrainerStub(channel).Capabilities(pb.TrainerCapabilitiesRequest(), timeout=WAIT_S,
                                                  metadata=((METADATA_KEY, secured.stack.internal_token),))


def test_the_owner_is_untouched(secured: Secured, owned: Owned) -> None:
    """Run last: the owner's run gives the same logprobs as before the intrusions, and its checkpoints and
    sampling session are all still there."""
    door = secured.grpc(OWNER_KEY)
    assert _forward(door, owned.model_id, 6) == owned.logprobs
    paths = {c.tinker_path for c in door.call("ListCheckpoints", pb.ListRunCheckpointsRequest(
        training_run_id=owned.model_id)).checkpoints}
    assert paths == {owned.state_path, owned.sampler_path}
    assert door.call("GetSamplingSession", pb.GetSamplingSessionRequest(
        sampling_session_id=owned.sampling_session_id)).model_path == owned.sampler_path
