"""Mixture-of-experts base models (the tiny Qwen3-MoE): routing's rules, tenants sharing a cycle on an MoE pool with
the bits each gets alone, and the official tinker SDK training and sampling it with sampler logprobs equal to the
trainer's. (Logits against transformers: test_hf_loading; LoRA gradients against float64: test_trainer_numerics;
sampler against trainer in-process, alone and busy: test_sampler; exports: test_export; RL: test_rl_example.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tinker
import torch

from lathe.models import moe
from lathe.models.catalog import ModelCatalog
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.v1 import lathe_pb2 as pb
from tests.helpers import next_token_datum
from tests.test_trainer_engine import batch, fb, submit

MOE = "lathe/tiny-qwen3-moe"
PROMPT = [5, 17, 42, 9, 33, 120, 7]

torch.set_num_threads(1)


def test_ties_go_to_the_lower_expert_and_each_experts_rows_stay_ascending() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0],  # experts 1 and 2 tie for first
                           [1.0, 1.0, 1.0, 1.0],  # all tie: the two lowest
                           [3.0, -1.0, 0.0, 3.0]])  # 0 and 3 tie
    routing = moe.route(logits, 2, normalize=True, dtype=torch.float32)
    assert routing.experts.tolist() == [[1, 2], [0, 1], [0, 3]]
    assert routing.weights.tolist() == [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
    assert routing.groups == [(0, [1, 2]), (1, [0, 1]), (2, [0]), (3, [2])]
    assert routing.load(5) == [2, 2, 1, 1, 0]
    # each group's outputs come back to (token, slot): slot j of token t holds its j-th expert's output
    outputs = [torch.full((len(rows), 1), float(e)) for e, rows in routing.groups]
    ys = torch.cat(outputs)[routing.inverse].view(3, 2)
    assert torch.equal(ys, routing.experts.float())


def test_weights_are_the_renormalized_top_k_of_the_softmax_and_outputs_sum_in_expert_order() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8, generator=gen)
    routing = moe.route(logits, 3, normalize=True, dtype=torch.float64)
    probs = logits.softmax(-1)
    top, idx = probs.topk(3)
    assert torch.equal(routing.experts, idx.sort(-1).values)
    want = (top / top.sum(-1, keepdim=True)).gather(1, idx.sort(-1).indices)
    torch.testing.assert_close(routing.weights, want.double(), rtol=1e-6, atol=0)
    unnormalized = moe.route(logits, 3, normalize=False, dtype=torch.float32)
    torch.testing.assert_close(unnormalized.weights.sum(-1), top.sum(-1))
    outputs = [torch.randn(len(rows), 4, generator=gen, dtype=torch.float64) for _, rows in routing.groups]
    out = moe.combine(outputs, routing)
    by_expert = dict(zip([e for e, _ in routing.groups], outputs, strict=True))
    for t in range(6):
        want_t = torch.zeros(4, dtype=torch.float64)
        for j, e in enumerate(routing.experts[t].tolist()):  # ascending experts, one add at a time
            row = dict(routing.groups)[e].index(t)
            want_t = want_t + by_expert[e][row] * routing.weights[t, j]
        assert torch.equal(out[t], want_t)


def _engine(model_cache: Path) -> TrainerEngine:
    """An MoE trainer pool, not started: the test runs its cycles."""
    return TrainerEngine(TrainerConfig(models=MOE, cache_root=model_cache), ModelCatalog.from_spec(MOE, model_cache))


def _create(eng: TrainerEngine, model_id: str, seed: int) -> None:
    eng.create_adapter(pb.CreateAdapterRequest(model_id=model_id, tenant="t", base_model=MOE,
                                               lora_config=pb.LoraConfig(rank=4, seed=seed, train_attn=True,
                                                                         train_mlp=True, train_unembed=True)))


def _grads(eng: TrainerEngine, model_id: str) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in eng.bank.get(model_id).weights.named_parameters().items()}


def test_two_tenants_share_a_cycle_on_an_moe_pool_and_each_gets_its_solo_bits(model_cache: Path) -> None:
    shared, solo = _engine(model_cache), _engine(model_cache)
    for eng in (shared, solo):
        _create(eng, "a", 1)
        _create(eng, "b", 2)
    futures = [submit(shared, fb(m, 1, batch(seed))) for m, seed in (("a", 3), ("b", 4))]
    shared.run_cycle()
    together = [f.result(timeout=60) for f in futures]
    assert together[0].receipt.cycle == together[1].receipt.cycle  # one pass over both tenants' tokens
    for (m, seed), packed in zip((("a", 3), ("b", 4)), together, strict=True):
        future = submit(solo, fb(m, 1, batch(seed)))
        solo.run_cycle()
        alone = future.result(timeout=60)
        assert alone.forward_backward.loss_fn_outputs == packed.forward_backward.loss_fn_outputs
        assert alone.forward_backward.metrics["loss:sum"] == packed.forward_backward.metrics["loss:sum"]
        got, want = _grads(shared, m), _grads(solo, m)
        assert sum(g is not None for g in got.values()) > len(got) // 2  # most experts saw a token
        for name in got:
            assert got[name] is want[name] is None or torch.equal(got[name], want[name]), name
    tokens = sum(len(d.model_input.chunks[0].tokens) for s in (3, 4) for d in batch(s))
    registry = shared.metrics.registry
    for layer in ("0", "1"):  # the load-balance metric: each token counted once per sparse layer for each of its k
        counts = [registry.get_sample_value("lathe_trainer_expert_tokens_total",
                                            {"model": MOE, "layer": layer, "expert": str(e)}) or 0.0
                  for e in range(8)]
        assert sum(counts) == 2 * tokens and sum(c > 0 for c in counts) > 2
    assert registry.get_sample_value("lathe_trainer_expert_imbalance", {"model": MOE}) >= 1.0


def test_the_official_sdk_trains_and_samples_an_moe_model_with_the_trainers_logprobs(stack: object) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-moe")
    caps = {m.model_name for m in sc.get_server_capabilities().supported_models}
    assert MOE in caps
    tc = sc.create_lora_training_client(MOE, rank=4, seed=5)
    data = [next_token_datum(PROMPT, tinker)]
    first = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(tinker.AdamParams(learning_rate=0.05)).result()
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < first  # it trained
    sampler = tc.save_weights_and_get_sampling_client()
    res = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 3,
                         tinker.SamplingParams(max_tokens=10, seed=9, stop=[])).result()
    for seq in res.sequences:
        full = PROMPT + seq.tokens
        fwd = tc.forward([tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]),
                                       loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()
        trainer = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[len(PROMPT) - 1:]
        assert np.array_equal(trainer, np.asarray(seq.logprobs, dtype=np.float32))
    sc.close("success").result()

