"""gRPC health on every service: SERVING once ready, without the internal secret; a pool whose loop died, or
that is still loading its models, is NOT_SERVING."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import lathe
from lathe.errors import Unavailable
from lathe.models.catalog import ModelCatalog
from lathe.runtime.internal_auth import RequireToken
from lathe.runtime.probes import LIVENESS, NOT_SERVING, SERVING, Probes, Warmup
from lathe.stack import POOL_MALLOC, Stack
from lathe.trainer import intake
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.server import TrainerServicer
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

BASE = "lathe/tiny-llama"
WAIT_S = 180.0
SERVICES = {"gateway": "lathe.v1.Gateway", "trainer": "lathe.v1.Trainer", "sampler": "lathe.v1.Sampler",
            "checkpoints": "lathe.v1.Checkpoints"}


def check(address: str, service: str = "") -> int:
    """One health Check, sent without any metadata (as kubelet sends it)."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=10).status


def wait_for(address: str, status: int, service: str = "") -> None:
    deadline = time.monotonic() + WAIT_S
    while check(address, service) != status:
        assert time.monotonic() < deadline, f"{address} {service!r} never became {status}"
        time.sleep(0.2)


def test_every_service_answers_serving_once_ready_without_the_secret(stack: Stack) -> None:
    for name, grpc_service in SERVICES.items():
        address = stack.service(name).address
        wait_for(address, SERVING)
        assert check(address, grpc_service) == SERVING
        assert check(address, LIVENESS) == SERVING
    # the exemption is the health service alone: the pools' own calls still need the secret
    with grpc.insecure_channel(stack.service("trainer").address) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.TrainerStub(channel).Capabilities(pb.TrainerCapabilitiesRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # a ready pool has loaded its model and run the self-check (the stack waited for SERVING before any test
    # trained on it): the capabilities say so
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-health") as sc:
        model = next(m for m in sc.get_server_capabilities().supported_models if m.model_name == BASE)
    assert model.trainer_exactness.checked and model.sampler_exactness.checked


def test_pools_start_with_the_pool_allocator_settings_and_the_other_services_without_them(stack: Stack) -> None:
    """The stack hands trainer, sampler and checkpoints glibc's pool settings (one arena, freed memory kept), unless
    the environment has its own; the gateway keeps the environment's; the torch-free services park their OpenMP
    threads.
    (Read from what the stack passes: glibc rewrites the copy a process shows in /proc/<pid>/environ.)"""
    mine = os.environ.get("GLIBC_TUNABLES")
    for s in stack.services:
        env = stack.service_env(s.name)
        pool = s.name in ("trainer", "sampler")
        assert env.get("GLIBC_TUNABLES") == ((mine or POOL_MALLOC) if pool or s.name == "checkpoints" else mine), s.name
        assert env.get("OMP_WAIT_POLICY") == (os.environ.get("OMP_WAIT_POLICY") if pool else
                                              os.environ.get("OMP_WAIT_POLICY", "PASSIVE")), s.name
        assert env["LATHE_INTERNAL_TOKEN"] == stack.internal_token


async def _status(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status


async def _until(stub: health_pb2_grpc.HealthStub, status: int, service: str = "") -> None:
    deadline = time.monotonic() + WAIT_S
    while await _status(stub, service) != status:
        assert time.monotonic() < deadline, f"{service!r} never became {status}"
        await asyncio.sleep(0.1)


def test_a_pool_is_ready_only_once_warm_and_not_alive_once_its_loop_died(
        model_cache: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache),
                           ModelCatalog.from_spec(BASE, model_cache))
    release = threading.Event()

    def load(name: str) -> object:
        assert release.wait(WAIT_S)
        return engine.base(name)

    def die() -> int:
        raise SystemExit("simulated death of the cycle thread")  # not an Exception: passes every guard

    async def scenario() -> None:
        engine.start()
        warm = Warmup(load, [BASE], lambda: engine.alive).start()
        probes = Probes("lathe.v1.Trainer", "lathe_trainer", warm.ready, warm.alive, engine.metrics.registry)
        server = grpc.aio.server(interceptors=[probes.requests, RequireToken("the-stack-secret")])
        pb_grpc.add_TrainerServicer_to_server(TrainerServicer(engine), server)
        probes.install(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await probes.start()
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                await asyncio.sleep(0.6)  # more than one poll: still loading
                assert await _status(health) == NOT_SERVING
                assert await _status(health, "lathe.v1.Trainer") == NOT_SERVING
                assert await _status(health, LIVENESS) == SERVING
                release.set()
                await _until(health, SERVING)
                assert BASE in engine.exactness.reports  # ready means loaded and self-checked
                with pytest.raises(grpc.aio.AioRpcError) as e:  # no secret: refused, unlike the health calls
                    await pb_grpc.TrainerStub(channel).Capabilities(pb.TrainerCapabilitiesRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                monkeypatch.setattr(engine, "run_cycle", die)
                monkeypatch.setattr(threading, "excepthook", lambda args: None)
                lora = pb.LoraConfig(rank=4, seed=1, train_mlp=True)
                engine.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE,
                                                              lora_config=lora))
                adam = pb.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)
                step = pb.TrainerOp(model_id="m", seq_id=1, tenant="t", request_id="m-1",
                                    optim_step=pb.OptimStepRequest(model_id="m", seq_id=1, adam_params=adam))
                fut = await asyncio.to_thread(intake.submit, engine, step)  # wakes the cycle thread, which dies
                assert isinstance((await asyncio.wrap_future(fut)).error, Unavailable)
                await _until(health, NOT_SERVING)
                await _until(health, NOT_SERVING, LIVENESS)
                await probes.shutdown()
                assert await _status(health, "lathe.v1.Trainer") == NOT_SERVING
        finally:
            await server.stop(None)
            engine.stop()

    asyncio.run(scenario())
