"""Hostile input inside the trainer engine (in-process): a bug in one operation fails that operation only, a
dead cycle thread is reported instead of waited on, a cycle's adapters are never paged out under it, one
tenant cannot fill the shared queue, and the gateway's idempotency map stays bounded."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from lathe.errors import InvalidArgument, ResourceExhausted, Unavailable
from lathe.gateway.core import GatewayCore
from lathe.gateway.records import Run
from lathe.models.catalog import ModelCatalog
from lathe.trainer import intake
from lathe.trainer import runner as runner_mod
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.v1 import lathe_pb2 as pb
from tests.helpers import pb_datum, pb_tensor
from tests.test_trainer_engine import submit

torch.set_num_threads(1)
BASE = "lathe/tiny-llama"
WAIT_S = 60.0


def _fb(model_id: str, seq: int, data: list[pb.Datum], tenant: str = "t", loss_fn: str = "cross_entropy"
        ) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant=tenant, request_id=f"{model_id}-{seq}",
                        forward_backward=pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, data=data,
                                                                   loss_fn=loss_fn))


def _opt(model_id: str, seq: int, tenant: str = "t") -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant=tenant, request_id=f"{model_id}-{seq}",
                        optim_step=pb.OptimStepRequest(model_id=model_id, seq_id=seq, adam_params=pb.AdamParams(
                            learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)))


def _engine(model_cache: Path, **kw: object) -> TrainerEngine:
    return TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache, **kw),
                         ModelCatalog.from_spec(BASE, model_cache))


def _create(eng: TrainerEngine, model_id: str, tenant: str = "t", seed: int = 3) -> None:
    eng.create_adapter(pb.CreateAdapterRequest(model_id=model_id, tenant=tenant, base_model=BASE,
                                               lora_config=pb.LoraConfig(rank=4, seed=seed, train_attn=True,
                                                                         train_mlp=True, train_unembed=True)))


def _weights(eng: TrainerEngine, model_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.bank.get(model_id).weights.named_parameters().items()}


TOKENS = [5, 17, 42, 9, 33, 120, 7, 88, 64, 3, 19]


def test_a_bug_while_checking_one_request_fails_it_alone(model_cache: Path, tiny_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception in the intake's checks (here: one they did not foresee) answers that request at once,
    before it is queued; its seq_id is passed over and the cycle thread lives."""
    real = intake.check_request

    def flaky(data, loss_fn, loss_fn_config, limits, custom=None):  # noqa: ANN001, ANN202 - check_request's
        if loss_fn == "ppo":
            raise ValueError("cannot reshape array of size 6 into shape (-2,-3)")
        return real(data, loss_fn, loss_fn_config, limits, custom)

    monkeypatch.setattr(intake, "check_request", flaky)
    eng = _engine(model_cache)
    eng.start()
    try:
        _create(eng, "a")
        bad = submit(eng, _fb("a", 1, [pb_datum(TOKENS)], loss_fn="ppo")).result(timeout=WAIT_S)
        assert bad.error.code == "Internal" and bad.error.message == (
            "checking seq_id 1 failed: ValueError: cannot reshape array of size 6 into shape (-2,-3)")
        assert not bad.HasField("receipt")  # refused at the intake: it never reached a cycle
        ok = [submit(eng, _fb("a", 2, [pb_datum(TOKENS)])), submit(eng, _opt("a", 3))]
        assert [f.result(timeout=WAIT_S).WhichOneof("result") for f in ok] == ["forward_backward", "optim_step"]
        assert eng.alive
    finally:
        eng.stop()


def test_a_dead_cycle_thread_answers_unavailable_instead_of_hanging(model_cache: Path, tiny_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _engine(model_cache)
    _create(eng, "a")
    waiting = submit(eng, _opt("a", 2))  # waits for seq 1

    def die() -> int:
        raise SystemExit("simulated death of the cycle thread")  # not an Exception: passes every guard

    monkeypatch.setattr(eng, "run_cycle", die)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's death is the point here
    eng.start()
    head = submit(eng, _opt("a", 1))
    for fut in (head, waiting):
        res = fut.result(timeout=WAIT_S)
        assert res.error.code == "Unavailable" and "cycle thread stopped" in res.error.message
    assert not eng.alive
    with pytest.raises(Unavailable, match="not ready"):
        submit(eng, _opt("a", 3))
    with pytest.raises(Unavailable, match="not ready"):
        eng.capabilities()
    with pytest.raises(Unavailable, match="not ready"):
        _create(eng, "b")


def test_creating_an_adapter_mid_cycle_never_pages_out_the_cycles_own(model_cache: Path, tiny_dir: Path,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for one resident adapter, another tenant's create_adapter lands while "a" is in its
    backward: a's gradients must stay on a's resident adapter, so its step equals an undisturbed run's."""
    real = runner_mod.run_jobs
    ref, eng = _engine(model_cache), _engine(model_cache, max_resident_adapters=1, page_store=str(tmp_path))
    for e in (ref, eng):
        _create(e, "a")

    def with_intruder(model, jobs, load=None):  # noqa: ANN001, ANN202 - run_jobs' signature
        _create(eng, "intruder", tenant="other")
        return real(model, jobs, load)

    monkeypatch.setattr(runner_mod, "run_jobs", with_intruder)
    futs = [submit(eng, _fb("a", 1, [pb_datum(TOKENS)])), submit(eng, _opt("a", 2))]
    eng.run_cycle()
    monkeypatch.setattr(runner_mod, "run_jobs", real)
    ref_futs = [submit(ref, _fb("a", 1, [pb_datum(TOKENS)])), submit(ref, _opt("a", 2))]
    ref.run_cycle()
    assert [f.result(timeout=WAIT_S).WhichOneof("result") for f in futs + ref_futs] == [
        "forward_backward", "optim_step"] * 2
    assert futs[1].result().optim_step.metrics["grad_norm:mean"] > 0
    assert eng.bank.resident == 1 and eng.bank.paged == 1
    got, want = _weights(eng, "a"), _weights(ref, "a")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_one_tenant_fills_only_its_own_share_of_the_queue(model_cache: Path, tiny_dir: Path) -> None:
    eng = _engine(model_cache, max_queue=6, max_queue_per_tenant=3)
    _create(eng, "a", tenant="alice")
    _create(eng, "b", tenant="bob")
    for seq in (2, 3, 4):  # far ahead of seq 1, which never comes
        submit(eng, _opt("a", seq, tenant="alice"))
    with pytest.raises(ResourceExhausted, match="this tenant has 3 operations waiting"):
        submit(eng, _opt("a", 5, tenant="alice"))
    assert submit(eng, _opt("a", 4, tenant="alice")).done() is False  # a repeat takes no new place
    for seq in (2, 3, 4):  # bob is not blocked by alice's queue
        submit(eng, _opt("b", seq, tenant="bob"))
    head = submit(eng, _opt("a", 1, tenant="alice"))  # the operation a run waits for is always let in
    while not head.done():
        eng.run_cycle()
    assert head.result().WhichOneof("result") == "optim_step"


def test_bad_loss_configs_and_rl_datums_are_refused_by_name(model_cache: Path, tiny_dir: Path) -> None:
    eng = _engine(model_cache)
    _create(eng, "rl")
    n = len(TOKENS)

    def rl(seq: int, loss_fn: str, logprobs: list[float], **config: float) -> str:
        d = pb_datum(TOKENS)
        del d.loss_fn_inputs["weights"]
        d.loss_fn_inputs["logprobs"].CopyFrom(pb_tensor(logprobs, "float32"))
        d.loss_fn_inputs["advantages"].CopyFrom(pb_tensor([1.0] * n, "float32"))
        op = _fb("rl", seq, [d], loss_fn=loss_fn)
        op.forward_backward.loss_fn_config.update(config)
        fut = submit(eng, op)
        eng.run_cycle()
        res = fut.result(timeout=WAIT_S)
        return res.error.code + ": " + res.error.message if res.WhichOneof("result") == "error" else "ok"

    assert "datum 0: loss_fn_inputs['logprobs'][2] = 0.5 is positive" in rl(1, "ppo", [-1.0, -1.0, 0.5] + [-1.0] * (
        n - 3))
    assert "clip_low_threshold = 1.5 is above clip_high_threshold = 1.2" in rl(2, "ppo", [-1.0] * n,
                                                                               clip_low_threshold=1.5)
    assert "loss_fn_config['beta'] = -0.1 must be a finite number >= 0" in rl(3, "dro", [-1.0] * n, beta=-0.1)
    assert rl(4, "ppo", [-1.0] * n) == "ok"
    assert eng.bank.get("rl").step == 0


def test_negative_and_too_many_dimensions_are_refused_by_datum_and_field(model_cache: Path, tiny_dir: Path) -> None:
    from lathe.trainer.validate import Limits, check_request

    limits = Limits(vocab_size=256, max_context=64, max_request_tokens=1024)
    for shape, message in (([-2, -3], "shape [-2, -3] has a negative dimension"),
                           ([1] * 9 + [6], "has 10 dimensions, over the limit of 8"),
                           ([0, 6], "shape [0, 6] does not hold 6 values")):
        d = pb_datum([1, 2, 3, 4, 5, 6])
        del d.loss_fn_inputs["target_tokens"].shape[:]
        d.loss_fn_inputs["target_tokens"].shape.extend(shape)
        with pytest.raises(InvalidArgument) as e:
            check_request([pb_datum([1, 2]), d], "cross_entropy", {}, limits)
        assert str(e.value).startswith("datum 1: loss_fn_inputs['target_tokens']: ") and message in str(e.value)


# ---------- the gateway's idempotency map ----------


def test_the_idempotency_map_forgets_with_the_futures_and_after_failed_submits() -> None:
    """``_by_seq`` keeps a seq_id only while its finished result is kept, and never keeps a failed submit."""

    async def scenario() -> None:
        core = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1")
        core.ledger.futures.keep_done = 5
        run = Run("m", "t", "s", BASE, pb.LoraConfig(rank=4), {})
        run.ready.set()
        core.runs.by_id["m"] = run
        refuse = {7}

        async def work(run: Run, op: pb.TrainerOp) -> pb.FutureResult:
            if op.seq_id in refuse:
                raise ResourceExhausted("trainer queue is full")
            return pb.FutureResult(optim_step=pb.OptimStepOutput())

        step = {"optim_step": pb.OptimStepRequest(adam_params=pb.AdamParams(beta1=0.9, beta2=0.95, eps=1e-8))}
        ids = {}
        for seq in range(1, 41):
            ids[seq] = core.runs.submit_op("t", "m", seq, step, work).request_id
            assert core.runs.submit_op("t", "m", seq, step, work).request_id == ids[seq]  # an idempotent repeat
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*core.ledger._tasks)
        assert len(core.ledger.futures) == 5 and len(core.ledger._by_seq) == 5
        assert sorted(k[1] for k in core.ledger._by_seq) == [36, 37, 38, 39, 40]
        res = await core.ledger.retrieve("t", ids[40], 1.0)
        assert res.WhichOneof("result") == "optim_step"
        refuse.clear()
        retry = core.runs.submit_op("t", "m", 7, step, work).request_id  # forgotten: the retry runs
        assert retry != ids[7]
        await asyncio.gather(*core.ledger._tasks)
        assert (await core.ledger.retrieve("t", retry, 1.0)).WhichOneof("result") == "optim_step"
        with pytest.raises(InvalidArgument, match="adam_params.eps = 0.0 must be > 0"):
            core.runs.submit_op("t", "m", 41, {"optim_step": pb.OptimStepRequest(adam_params=pb.AdamParams())}, work)
        assert ("m", 41) not in core.ledger._by_seq
        await core.close()

    asyncio.run(scenario())
