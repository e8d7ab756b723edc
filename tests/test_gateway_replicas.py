"""Two gateway replicas over one control-plane database serve the same runs: a run created through one is
trained through both, its futures retrieved through either, and a seq_id sent to both names one request. The
weights it ends with equal those of the same operations through a single gateway, bit for bit."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from lathe.stack import Stack, StackConfig
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from tests.helpers import next_token_pb_datum

BASE = "lathe/tiny-llama"
KEY = (("x-api-key", "tml-replicas"),)
ADAM = pb.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("replicas")
    cfg = StackConfig(models=BASE, store_root=root / "store", cache_root=model_cache, trainer_threads=1,
                      sampler_threads=1, http_port=-1, gateways=2, db_url=f"sqlite:///{root}/control.db")
    with Stack(cfg) as s:
        yield s


def datum(seed: int) -> pb.Datum:
    return next_token_pb_datum(np.random.default_rng(seed).integers(3, 250, size=14))


def result(stub: pb_grpc.GatewayStub, request_id: str) -> pb.FutureResult:
    for _ in range(60):  # bounded: each poll is held up to 30 s by the gateway
        res = stub.RetrieveFuture(pb.RetrieveFutureRequest(request_id=request_id, timeout_s=30), metadata=KEY)
        if res.done:
            assert not res.HasField("error"), res.error.message
            return res
    raise AssertionError(f"{request_id} did not finish")


def train(stubs: list[pb_grpc.GatewayStub], steps: int = 4) -> list[float]:
    """Create a run through the first stub, then send step k through ``stubs[k % n]`` (its optim_step through
    the next one) and read each result through yet another; the final forward's logprobs."""
    turn = itertools.cycle(stubs)
    first = next(turn)
    session = first.CreateSession(pb.CreateSessionRequest(), metadata=KEY).session_id
    lora = pb.LoraConfig(rank=4, seed=9, train_attn=True, train_mlp=True)
    made = first.CreateModel(pb.CreateModelRequest(session_id=session, base_model=BASE, lora_config=lora),
                             metadata=KEY)
    result(next(turn), made.request_id)
    model_id, seq = made.model_id, itertools.count(1)
    data = [datum(i) for i in range(3)]
    for _ in range(steps):
        fb = next(turn).ForwardBackward(pb.ForwardBackwardRequest(
            model_id=model_id, seq_id=next(seq), data=data, loss_fn="cross_entropy"), metadata=KEY)
        n = next(seq)
        opt = next(turn).OptimStep(pb.OptimStepRequest(model_id=model_id, seq_id=n, adam_params=ADAM), metadata=KEY)
        again = next(turn).OptimStep(pb.OptimStepRequest(model_id=model_id, seq_id=n, adam_params=ADAM),
                                     metadata=KEY)  # the same seq_id through the other replica
        assert again.request_id == opt.request_id
        result(next(turn), fb.request_id)
        result(next(turn), opt.request_id)
    fwd = next(turn).ForwardBackward(pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=next(seq), data=data, loss_fn="cross_entropy", forward_only=True), metadata=KEY)
    out = result(next(turn), fwd.request_id).forward_backward.loss_fn_outputs
    return [float(x) for o in out for x in np.frombuffer(o.tensors["logprobs"].data, np.float32)]


@pytest.mark.slow
def test_two_gateways_over_one_database_serve_the_same_run(stack: Stack) -> None:
    assert len(stack.gateways) == 2 and stack.gateways[0] != stack.gateways[1]
    channels = [grpc.insecure_channel(a) for a in stack.gateways]
    try:
        stubs = [pb_grpc.GatewayStub(ch) for ch in channels]
        both = train(stubs)
        one = train(stubs[:1])
    finally:
        for ch in channels:
            ch.close()
    assert both == one  # bit for bit
