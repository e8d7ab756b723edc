"""Lathe's SDK against an in-process fake ``lathe.v1.Gateway`` (tests/fake_gateway.py): seq_id order and retries,
long-polled futures, error mapping, the API key, the REST client. Wire round trips and Datum conversions:
tests/test_sdk_wire.py."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

import lathe
from lathe import service_client, wire
from lathe.futures import RetryPolicy
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from tests.fake_gateway import BASE, KEY, FakeGateway
from tests.helpers import next_token_datum


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
