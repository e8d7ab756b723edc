"""The trainer engine in-process: cycles. A batch over capacity split across cycles, a small tenant not starved
behind a large one, one tenant's failure, paging and packing that change nothing, the cycle metrics, and the
rejoin window in which the runs of the last cycle come back. Ordering, exactly-once, bad input:
test_trainer_engine.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lathe.models.catalog import ModelCatalog
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.v1 import lathe_pb2 as pb
from tests.helpers import pb_tensor
from tests.test_trainer_engine import BASE, _engine, _lp, batch, create, fb, opt, submit, weights


def test_batch_over_capacity_is_split_across_cycles_and_equals_unsplit(model_cache: Path, tiny_dir: Path) -> None:
    split, whole = _engine(model_cache, cycle_tokens=40), _engine(model_cache)
    data = batch(5, n=8)  # about 140 tokens: four or more cycles of 40
    out = {}
    for name, eng in (("split", split), ("whole", whole)):
        create(eng, "m")
        f1, f2 = submit(eng, fb("m", 1, data)), submit(eng, opt("m", 2))
        while not f2.done():
            assert eng.run_cycle() > 0
        out[name] = (f1.result(), f2.result(), weights(eng, "m"), eng.cycle)
    (s_fb, s_opt, s_w, s_cycles), (w_fb, _, w_w, w_cycles) = out["split"], out["whole"]
    assert w_cycles == 1 and s_cycles >= 4
    assert s_fb.receipt.cycle == s_opt.receipt.cycle == s_cycles  # the step lands with the last part
    assert s_fb.forward_backward.metrics["loss:sum"] == pytest.approx(w_fb.forward_backward.metrics["loss:sum"],
                                                                      rel=1e-6)
    for a, b in zip(_lp(s_fb), _lp(w_fb), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for k in s_w:
        assert float((s_w[k] - w_w[k]).norm()) <= 1e-6 * max(float(w_w[k].norm()), 1e-12), k


def test_small_tenant_is_not_starved_behind_a_large_one(model_cache: Path, tiny_dir: Path) -> None:
    eng = _engine(model_cache, cycle_tokens=40)
    create(eng, "big")
    create(eng, "small")
    f_big = submit(eng, fb("big", 1, batch(9, n=10)))
    f_small = [submit(eng, fb("small", 1, batch(1, n=1))), submit(eng, opt("small", 2))]
    while not f_small[1].done():
        eng.run_cycle()
    assert not f_big.done(), "the small tenant finished while the large request was still being split"
    while not f_big.done():
        eng.run_cycle()
    assert f_small[1].result().receipt.cycle < f_big.result().receipt.cycle


def test_one_tenants_failure_leaves_the_others_untouched(model_cache: Path, tiny_dir: Path) -> None:
    alone, mixed = _engine(model_cache), _engine(model_cache)
    for eng in (alone, mixed):
        create(eng, "good")
    create(mixed, "poisoned")
    with torch.no_grad():
        for p in mixed.bank.get("poisoned").weights.parameters():
            p.fill_(float("nan"))
    f_alone = submit(alone, fb("good", 1, batch(2)))
    f_bad, f_good = submit(mixed, fb("poisoned", 1, batch(3))), submit(mixed, fb("good", 1, batch(2)))
    alone.run_cycle()
    mixed.run_cycle()
    bad, good, ref = f_bad.result(), f_good.result(), f_alone.result()
    assert bad.receipt.cycle == good.receipt.cycle == 1  # they really shared the cycle
    assert bad.WhichOneof("result") == "error" and "is nan" in bad.error.message
    assert all(np.array_equal(a, b) for a, b in zip(_lp(good), _lp(ref), strict=True))
    ga = {k: p.grad for k, p in mixed.bank.get("good").weights.named_parameters().items()}
    gb = {k: p.grad for k, p in alone.bank.get("good").weights.named_parameters().items()}
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_paging_adapters_out_and_back_in_changes_nothing(model_cache: Path, tiny_dir: Path, tmp_path: Path) -> None:
    tight = _engine(model_cache, max_resident_adapters=1, page_store=str(tmp_path / "pages"))
    roomy = _engine(model_cache)
    results: dict[str, list[pb.TrainerResult]] = {"tight": [], "roomy": []}
    paged_seen = 0
    for name, eng in (("tight", tight), ("roomy", roomy)):
        for mid in ("a", "b", "c"):
            create(eng, mid, seed=ord(mid))
        for k in range(3):  # forward_backward in one cycle, its optim_step in a later one
            for kind in (fb, opt):
                futs = [submit(eng, kind(mid, 2 * k + (1 if kind is fb else 2), *([batch(k)] if kind is fb else [])))
                        for mid in ("a", "b", "c")]
                eng.run_cycle()
                results[name] += [f.result() for f in futs]
                if name == "tight":
                    paged_seen = max(paged_seen, eng.bank.paged)
                    assert eng.bank.resident == 1
    assert paged_seen == 2
    for r_t, r_r in zip(results["tight"], results["roomy"], strict=True):
        assert r_t.WhichOneof("result") == r_r.WhichOneof("result")
        if r_t.WhichOneof("result") == "forward_backward":
            assert all(np.array_equal(a, b) for a, b in zip(_lp(r_t), _lp(r_r), strict=True))
    for mid in ("a", "b", "c"):
        assert all(torch.equal(weights(tight, mid)[k], v) for k, v in weights(roomy, mid).items())


def test_packed_tenants_equal_each_tenant_alone(model_cache: Path, tiny_dir: Path) -> None:
    """Mixed ranks, LoRA flags, losses and sequence lengths in one cycle vs. every tenant on its own."""
    tenants = [("r2", 2, "cross_entropy", 1), ("r8", 8, "importance_sampling", 3), ("r4", 4, "ppo", 2),
               ("r16", 16, "dro", 4), ("r5", 5, "cispo", 1)]

    def rl_batch(seed: int, n: int) -> list[pb.Datum]:
        data = batch(seed, n)
        for d in data:
            length = len(d.model_input.chunks[0].tokens)
            rng = np.random.default_rng(seed)
            d.loss_fn_inputs.pop("weights")
            d.loss_fn_inputs["logprobs"].CopyFrom(pb_tensor(-rng.exponential(3.0, length), "float32"))
            d.loss_fn_inputs["advantages"].CopyFrom(pb_tensor(rng.normal(0, 1, length), "float32"))
        return data

    def ops(mid: str, loss: str, n: int, seed: int) -> list[pb.TrainerOp]:
        data = batch(seed, n) if loss == "cross_entropy" else rl_batch(seed, n)
        return [fb(mid, 1, data, loss), opt(mid, 2), fb(mid, 3, data, loss)]

    def flags(rank: int) -> pb.LoraConfig:
        return pb.LoraConfig(rank=rank, seed=rank, train_attn=rank != 8, train_mlp=rank != 4,
                             train_unembed=rank % 2 == 0)

    packed = _engine(model_cache)
    for mid, rank, _, _ in tenants:
        packed.create_adapter(pb.CreateAdapterRequest(model_id=mid, tenant="t", base_model=BASE,
                                                      lora_config=flags(rank)))
    futs = {mid: [submit(packed, op) for op in ops(mid, loss, n, rank)] for mid, rank, loss, n in tenants}
    while packed.run_cycle():
        pass
    cycles = {mid: [f.result().receipt.cycle for f in fs] for mid, fs in futs.items()}
    assert len({c[0] for c in cycles.values()}) == 1, "all tenants shared the first cycle"
    for mid, rank, loss, n in tenants:
        alone = _engine(model_cache)
        alone.create_adapter(pb.CreateAdapterRequest(model_id=mid, tenant="t", base_model=BASE,
                                                     lora_config=flags(rank)))
        ref = [submit(alone, op) for op in ops(mid, loss, n, rank)]
        while alone.run_cycle():
            pass
        for f_p, f_a in zip(futs[mid], ref, strict=True):
            p, a = f_p.result(), f_a.result()
            assert p.WhichOneof("result") == a.WhichOneof("result") != "error"
            if p.WhichOneof("result") == "forward_backward":
                assert p.forward_backward.metrics["loss:sum"] == pytest.approx(
                    a.forward_backward.metrics["loss:sum"], rel=1e-6)
                for x, y in zip(_lp(p), _lp(a), strict=True):
                    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
        for k, v in weights(alone, mid).items():
            w = weights(packed, mid)[k]
            assert float((w - v).norm()) <= 1e-6 * max(float(v.norm()), 1e-12), (mid, k)


def test_cycle_metrics_are_exported(model_cache: Path, tiny_dir: Path) -> None:
    from prometheus_client import generate_latest

    eng = _engine(model_cache, cycle_tokens=1000)
    create(eng, "a")
    create(eng, "b")
    submit(eng, fb("a", 1, batch(0)))
    submit(eng, fb("b", 1, batch(1)))
    eng.run_cycle()
    text = generate_latest(eng.metrics.registry).decode()
    tokens = sum(len(d.model_input.chunks[0].tokens) for d in batch(0) + batch(1))
    assert "lathe_trainer_cycles_total 1.0" in text
    assert f"lathe_trainer_cycle_tokens_total {float(tokens)}" in text
    assert "lathe_trainer_adapters_in_cycle 2.0" in text
    assert f"lathe_trainer_cycle_utilization {tokens / 1000}" in text
    assert "lathe_trainer_cycle_capacity_tokens 1000.0" in text
    assert "lathe_trainer_resident_adapters 2.0" in text
    assert "lathe_trainer_operation_wait_seconds_count 2.0" in text
    assert 'lathe_trainer_exactness{model="lathe/tiny-llama"} 1.0' in text  # the self-check ran at load
    model = next(m for m in eng.capabilities().supported_models if m.model_name == "lathe/tiny-llama")
    assert model.trainer_exactness.checked and model.trainer_exactness.exact


def test_a_cycle_waits_for_the_runs_of_the_last_one_to_rejoin(model_cache: Path, tiny_dir: Path) -> None:
    """Clients answered by the same cycle resubmit milliseconds apart; the next cycle waits (a bounded share of
    the last one) for every run of the last cycle, so the first to resubmit does not take a cycle alone."""
    cfg = TrainerConfig(models=BASE, cache_root=model_cache, rejoin_fraction=1e6, rejoin_max_s=60.0,
                        cycle_gather_s=60.0)  # windows no machine is slow enough to miss
    eng = TrainerEngine(cfg, ModelCatalog.from_spec(BASE, model_cache))
    for m in ("a", "b"):
        create(eng, m)
    first = [submit(eng, op) for m in ("a", "b") for op in (fb(m, 1, batch(1)), opt(m, 2))]
    eng.start()  # both runs' first operations were queued before the loop: one cycle
    try:
        assert len({f.result(timeout=60).receipt.cycle for f in first}) == 1
        early = [submit(eng, op) for op in (fb("a", 3, batch(2)), opt("a", 4))]
        late = [submit(eng, op) for op in (fb("b", 3, batch(3)), opt("b", 4))]
        cycles = {f.result(timeout=60).receipt.cycle for f in early + late}
        assert cycles == {2}, cycles
    finally:
        eng.stop()


def test_the_rejoin_window_renews_as_each_run_of_the_last_cycle_comes_back(model_cache: Path, tiny_dir: Path
                                                                           ) -> None:
    """Through a busy gateway a burst of clients answered together spreads over more than one window; each
    run that comes back renews it, so the burst still shares one cycle (three runs 1.6 s apart, a 3 s window:
    the last arrives 3.2 s after the cycle, and before the window renewed by the second runs out)."""
    cfg = TrainerConfig(models=BASE, cache_root=model_cache, rejoin_fraction=1e6, rejoin_max_s=3.0,
                        cycle_gather_s=60.0)
    eng = TrainerEngine(cfg, ModelCatalog.from_spec(BASE, model_cache))
    runs = ("a", "b", "c")
    for m in runs:
        create(eng, m)
    first = [submit(eng, op) for m in runs for op in (fb(m, 1, batch(1)), opt(m, 2))]
    eng.start()
    try:
        assert {f.result(timeout=60).receipt.cycle for f in first} == {1}
        later = []
        for m in runs:
            time.sleep(1.6)
            later += [submit(eng, op) for op in (fb(m, 3, batch(2)), opt(m, 4))]
        assert {f.result(timeout=60).receipt.cycle for f in later} == {2}
    finally:
        eng.stop()


def test_a_run_that_does_not_rejoin_delays_the_next_cycle_a_bounded_time(model_cache: Path, tiny_dir: Path) -> None:
    # cycle_gather_s: each forward_backward waits for its optim_step however slow the machine, so only the
    # rejoin window decides the cycles
    cfg = TrainerConfig(models=BASE, cache_root=model_cache, rejoin_fraction=1e6, rejoin_max_s=0.2,
                        cycle_gather_s=60.0)
    eng = TrainerEngine(cfg, ModelCatalog.from_spec(BASE, model_cache))
    for m in ("a", "b"):
        create(eng, m)
    first = [submit(eng, op) for m in ("a", "b") for op in (fb(m, 1, batch(1)), opt(m, 2))]
    eng.start()
    try:
        for f in first:
            f.result(timeout=60)
        alone = [submit(eng, op) for op in (fb("a", 3, batch(2)), opt("a", 4))]  # "b" never sends another
        assert [f.result(timeout=60).receipt.cycle for f in alone] == [2, 2]
    finally:
        eng.stop()
    with pytest.raises(ValueError, match="rejoin_fraction"):
        TrainerConfig(rejoin_fraction=-1.0)


@pytest.mark.processes
@pytest.mark.parametrize(("flag", "said"), [
    ("--rejoin-fraction", "rejoin_fraction, rejoin_max_s and rejoin_write_max_s must be >= 0, got -1.0, 0.1 and 2.0"),
    ("--rejoin-write-max-s", "rejoin_fraction, rejoin_max_s and rejoin_write_max_s must be >= 0, got 0.05, 0.1 and "
                             "-1.0"),
    ("--cycle-gather-s", "cycle_gather_s must be >= 0 seconds, got -1.0"),
])
def test_the_trainer_refuses_a_negative_cycle_window_as_a_usage_error(flag: str, said: str) -> None:
    bad = subprocess.run([sys.executable, "-m", "lathe.trainer", flag, "-1"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and f"error: {said}" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
