"""The trainer engine in-process: ordering, exactly-once, bad input (at the intake, in a cycle, floods), each
adapter rank's self-check. Cycles: test_trainer_engine_cycles.py."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from lathe.models.catalog import ModelCatalog
from lathe.trainer import intake
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.ops import ForwardBackward, Limits, Op, OptimStep, Save, Skip
from lathe.types import AdamParams
from lathe.v1 import lathe_pb2 as pb
from tests.helpers import pb_datum, pb_tensor

torch.set_num_threads(1)
BASE = "lathe/tiny-llama"


def submit(eng: TrainerEngine, op: pb.TrainerOp) -> Future:
    """``Trainer.Run`` without the network: the intake decodes, checks and queues ``op`` (raising what the door
    would abort with); the future resolves to the ``pb.TrainerResult`` the door would send."""
    out: Future = Future()

    def answer(fut: Future) -> None:
        try:
            out.set_result(intake.result_to_proto(fut.result()))
        except Exception as e:  # noqa: BLE001 - handed to the test that waits on it
            out.set_exception(e)

    intake.submit(eng, op).add_done_callback(answer)
    return out


def batch(seed: int, n: int = 3) -> list[pb.Datum]:
    rng = random.Random(seed)
    return [pb_datum([rng.randrange(1, 200) for _ in range(rng.randrange(5, 30))]) for _ in range(n)]


def fb(model_id: str, seq: int, data: list[pb.Datum], loss_fn: str = "cross_entropy") -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", request_id=f"r{seq}",
                        forward_backward=pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, data=data,
                                                                   loss_fn=loss_fn))


def opt(model_id: str, seq: int, lr: float = 1e-2) -> pb.TrainerOp:
    return pb.TrainerOp(model_id=model_id, seq_id=seq, tenant="t", request_id=f"r{seq}",
                        optim_step=pb.OptimStepRequest(model_id=model_id, seq_id=seq,
                                                       adam_params=pb.AdamParams(learning_rate=lr, beta1=0.9,
                                                                                 beta2=0.95, eps=1e-12)))


@pytest.fixture()
def engine(model_cache: Path, tiny_dir: Path) -> TrainerEngine:
    eng = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache), ModelCatalog.from_spec(BASE, model_cache))
    eng.start()
    yield eng
    eng.stop()


def create(eng: TrainerEngine, model_id: str, rank: int = 4, seed: int = 7) -> None:
    eng.create_adapter(pb.CreateAdapterRequest(model_id=model_id, tenant="t", base_model=BASE,
                                               lora_config=pb.LoraConfig(rank=rank, seed=seed, train_attn=True,
                                                                         train_mlp=True, train_unembed=True)))


def weights(eng: TrainerEngine, model_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.bank.get(model_id).weights.named_parameters().items()}


def ops_for(model_id: str) -> list[pb.TrainerOp]:
    out = []
    for k in range(4):
        out += [fb(model_id, 2 * k + 1, batch(k)), opt(model_id, 2 * k + 2)]
    return out


def test_out_of_order_and_duplicated_delivery_equals_in_order(engine: TrainerEngine) -> None:
    create(engine, "in-order")
    create(engine, "shuffled")
    for op in ops_for("in-order"):
        submit(engine, op).result(timeout=60)
    ops = ops_for("shuffled")
    delivery = ops + random.Random(0).sample(ops, 5)  # every op once, then five repeats
    random.Random(1).shuffle(delivery)
    futures: list = []
    threads = [threading.Thread(target=lambda o=o: futures.append((o.seq_id, submit(engine, o)))) for o in delivery]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results: dict[int, pb.TrainerResult] = {}
    for seq, f in futures:
        r = f.result(timeout=60)
        assert results.setdefault(seq, r) == r, "a repeated seq_id must get the first delivery's answer"
    assert [results[s].receipt.seq_id for s in sorted(results)] == list(range(1, 9))
    assert [results[s].receipt.adapter_step for s in sorted(results)] == [0, 1, 1, 2, 2, 3, 3, 4]
    a, b = weights(engine, "in-order"), weights(engine, "shuffled")
    assert engine.bank.get("shuffled").step == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], weights_init) for k, weights_init in _fresh(engine).items())


def _fresh(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    create(engine, "fresh")
    return weights(engine, "fresh")


def test_forward_backward_and_optim_step_share_a_cycle(engine: TrainerEngine) -> None:
    create(engine, "m")
    f2 = submit(engine, opt("m", 2))
    f1 = submit(engine, fb("m", 1, batch(3)))
    r1, r2 = f1.result(timeout=60), f2.result(timeout=60)
    assert r1.receipt.cycle == r2.receipt.cycle
    assert r1.forward_backward.metrics["loss:sum"] > 0
    assert r2.receipt.adapter_step == 1


BAD = [
    (lambda: [pb_datum([1, 2, 3], target_tokens=pb_tensor([2, 3], "int64"))],
     "datum 0: loss_fn_inputs['target_tokens'] has length 2 but model_input has 3 tokens"),
    (lambda: [pb_datum([1, 2, 3], weights=pb_tensor([1.0, 1.0], "float32"))],
     "datum 0: loss_fn_inputs['weights'] has length 2"),
    (lambda: [pb_datum([5, 6]), pb.Datum()], "datum 1: model_input is empty"),
    (lambda: [pb_datum([1, -4, 3])], "datum 0: model_input[1] = -4 is outside the vocabulary"),
    (lambda: [pb_datum([1, 99999, 3])], "datum 0: model_input[1] = 99999 is outside the vocabulary"),
    (lambda: [pb_datum([1, 2, 3], target_tokens=pb_tensor([2, 3, 10**6], "int64"))],
     "loss_fn_inputs['target_tokens'][2] = 1000000 is outside"),
    (lambda: [pb_datum([1, 2, 3], weights=pb_tensor([1.0, float("nan"), 1.0], "float32"))],
     "loss_fn_inputs['weights'][1] = nan is not finite"),
    (lambda: [pb_datum([1, 2, 3], advantages=pb_tensor([0.0] * 3, "float32"))],
     "unknown key(s) ['advantages'] for loss 'cross_entropy'"),
    (lambda: [pb_datum([1, 2, 3], target_tokens=pb_tensor([2.0, 3.0, 4.0], "float32"))],
     "loss_fn_inputs['target_tokens']: dtype float32 must be int64"),
    (lambda: [pb_datum(list(range(1, 600)))], "model_input has 599 tokens, over the model's context length 512"),
    (lambda: [], "data is empty"),
]


@pytest.mark.parametrize("make,message", BAD)
def test_bad_input_is_rejected_with_its_message_and_changes_nothing(engine: TrainerEngine, make, message) -> None:  # noqa: ANN001
    create(engine, "bad")
    submit(engine, fb("bad", 1, batch(0))).result(timeout=60)  # leaves a gradient to protect
    before = weights(engine, "bad")
    grads = {k: p.grad.clone() for k, p in engine.bank.get("bad").weights.named_parameters().items()}
    res = submit(engine, fb("bad", 2, make())).result(timeout=60)
    assert res.WhichOneof("result") == "error"
    assert res.error.code == "InvalidArgument" and res.error.category == "user"
    assert message in res.error.message
    for k, p in engine.bank.get("bad").weights.named_parameters().items():
        assert torch.equal(p.detach(), before[k]) and torch.equal(p.grad, grads[k])
    ok = submit(engine, opt("bad", 3)).result(timeout=60)  # the run goes on
    assert ok.WhichOneof("result") == "optim_step" and ok.receipt.adapter_step == 1


def test_unknown_loss_and_bad_config_and_bad_adam(engine: TrainerEngine) -> None:
    create(engine, "cfg")
    r = submit(engine, fb("cfg", 1, batch(0), loss_fn="hinge")).result(timeout=60)
    assert "unknown loss_fn 'hinge'" in r.error.message
    op = fb("cfg", 2, batch(0), loss_fn="ppo")
    op.forward_backward.loss_fn_config["clip_low"] = 0.5
    assert "loss_fn_config has unknown key(s) ['clip_low']" in submit(engine, op).result(timeout=60).error.message
    bad = opt("cfg", 3, lr=-1.0)
    assert "adam_params.learning_rate = -1.0" in submit(engine, bad).result(timeout=60).error.message


def test_bad_lora_config_and_unknown_base_model(engine: TrainerEngine) -> None:
    from lathe.errors import InvalidArgument, NotFound

    with pytest.raises(InvalidArgument, match="lora rank must be in"):
        create(engine, "r0", rank=0)
    with pytest.raises(NotFound, match="nope"):
        engine.create_adapter(pb.CreateAdapterRequest(model_id="x", tenant="t", base_model="nope",
                                                      lora_config=pb.LoraConfig(rank=4, train_mlp=True)))


def _engine(model_cache: Path, **kw: object) -> TrainerEngine:
    return TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache, **kw),
                         ModelCatalog.from_spec(BASE, model_cache))


def _lp(r: pb.TrainerResult) -> list[np.ndarray]:
    return [np.frombuffer(o.tensors["logprobs"].data, np.float32) for o in r.forward_backward.loss_fn_outputs]


def test_floods_and_over_long_requests_get_clear_errors(model_cache: Path, tiny_dir: Path) -> None:
    from lathe.errors import ResourceExhausted

    eng = _engine(model_cache, max_queue=2, max_request_tokens=50)
    create(eng, "m")
    submit(eng, fb("m", 2, batch(0)))  # seq 1 has not arrived: these wait in the queue
    submit(eng, opt("m", 3))
    with pytest.raises(ResourceExhausted, match="trainer queue is full"):
        submit(eng, fb("m", 4, batch(1)))
    big = submit(eng, fb("m", 1, [pb_datum(list(range(1, 40))), pb_datum(list(range(1, 30)))]))
    eng.run_cycle()
    err = big.result(timeout=10).error
    assert err.code == "InvalidArgument" and "request has 68 tokens in 2 datums, over the limit of 50" in err.message


def test_the_intake_decodes_plain_operations_and_turns_a_bad_one_into_a_skip() -> None:
    limits = Limits(vocab_size=256, max_context=64, max_request_tokens=1024)
    data = [pb_datum([4, 5, 6], weights=pb_tensor([1.0, 0.0, 1.0], "float32"))]
    got = intake.decode_op(fb("m", 1, data), limits)
    assert (got.model_id, got.seq_id, got.request_id, got.tenant, got.kind) == ("m", 1, "r1", "t", "forward_backward")
    assert isinstance(got.body, ForwardBackward) and got.body.backward and got.body.loss_fn == "cross_entropy"
    ex = got.body.examples[0]
    assert ex.tokens == [4, 5, 6] and ex.targets.tolist() == [5, 6, 4] and ex.inputs["weights"].tolist() == [1, 0, 1]
    assert intake.decode_op(opt("m", 2, lr=0.5), limits).body == OptimStep(AdamParams(0.5, 0.9, 0.95, 1e-12, 0, 0))
    save = pb.TrainerOp(model_id="m", seq_id=3, tenant="t", request_id="r3", max_checkpoint_bytes=99,
                        save=pb.SaveRequest(name="n", kind="weights", ttl_seconds=5, user_metadata={"a": "b"}))
    assert intake.decode_op(save, limits) == Op("m", 3, "r3", "t", Save("weights", "n", 5, False, {"a": "b"}, 99))
    save.save.kind = "everything"
    refused = {
        "save": save,
        "vocab": fb("m", 4, [pb_datum([4, 300, 6])]),
        "empty": pb.TrainerOp(model_id="m", seq_id=5, tenant="t"),
        "gateway": pb.TrainerOp(model_id="m", seq_id=6, tenant="t", skip=pb.SkipRequest(reason="eps = 0")),
    }
    messages = {k: intake.decode_op(v, limits).body for k, v in refused.items()}
    assert all(isinstance(b, Skip) and b.error.category == "user" for b in messages.values())
    assert {k: b.error.message for k, b in messages.items()} == {
        "save": "save kind 'everything' must be 'weights' or 'sampler_weights'",
        "vocab": "datum 0: model_input[1] = 300 is outside the vocabulary [0, 256)",
        "empty": "TrainerOp seq_id 5 has no operation: one of forward_backward, optim_step, save, load or skip is "
                 "needed",
        "gateway": "seq_id 6 was refused by the gateway: eps = 0"}


def test_a_bad_request_is_answered_at_the_intake_and_never_holds_the_run(model_cache: Path, tiny_dir: Path) -> None:
    eng = _engine(model_cache)  # no cycle thread: only the cycles run below compute anything
    create(eng, "m")
    bad = submit(eng, fb("m", 2, [pb_datum([1, 99999, 3])]))  # seq_id 1 has not arrived yet
    assert bad.done() and eng.cycle == 0, "refused before it was queued, without waiting for its turn"
    assert bad.result().error.code == "InvalidArgument" and not bad.result().HasField("receipt")
    later, first = submit(eng, opt("m", 3)), submit(eng, fb("m", 1, batch(0)))
    while not later.done():
        assert eng.run_cycle() > 0
    assert first.result().receipt.cycle == later.result().receipt.cycle == 1  # seq_id 2 was passed over
    assert later.result().receipt.adapter_step == 1 and eng.bank.get("m").step == 1


@pytest.mark.parametrize("field,values,message", [
    ("advantages", [0.0, 1.0], "loss_fn_inputs['advantages'] has length 2 but model_input has 3 tokens"),
    ("logprobs", [-1.0, -1.0, -1.0, -1.0], "loss_fn_inputs['logprobs'] has length 4 but model_input has 3 tokens"),
    ("advantages", [0.0, float("inf"), 1.0], "loss_fn_inputs['advantages'][1] = inf is not finite"),
])
def test_bad_rl_datums_are_rejected(engine: TrainerEngine, field: str, values: list[float], message: str) -> None:
    create(engine, "rl")
    inputs = {"logprobs": pb_tensor([-1.0] * 3, "float32"), "advantages": pb_tensor([0.5] * 3, "float32")}
    inputs[field] = pb_tensor(values, "float32")
    d = pb.Datum(model_input=pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=[4, 5, 6])]),
                 loss_fn_inputs={"target_tokens": pb_tensor([5, 6, 7], "int64"), **inputs})
    res = submit(engine, fb("rl", 1, [d], "importance_sampling")).result(timeout=60)
    assert res.error.code == "InvalidArgument" and message in res.error.message
    assert engine.bank.get("rl").step == 0 and not engine.bank.get("rl").has_grads()


def test_each_adapter_rank_is_self_checked_before_its_first_pass(engine: TrainerEngine) -> None:
    """The pool's report starts with the self-check's rank; ranks 4 and 12 are checked when their adapters
    first compute, and the pool stays exact (gauge included)."""
    create(engine, "small", rank=4)
    create(engine, "odd", rank=12)
    done = [submit(engine, fb(m, 1, batch(3))) for m in ("small", "odd")]
    assert all(f.result(timeout=120).forward_backward.metrics["loss:sum"] > 0 for f in done)
    report = engine.exactness.reports[BASE]
    assert report.ranks == [4, 8, 12] and report.exact
    assert any("lora expand 12->" in c.name for c in report.checks)
    assert engine.metrics.exactness.labels(model=BASE)._value.get() == 1.0
