"""Sampling and RL across real processes: sampler logprobs equal trainer logprobs, and RL moves the policy."""

from __future__ import annotations

import numpy as np
import pytest

import lathe
from lathe.stack import Stack
from tests.helpers import next_token_datum, rl_datum

BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]


def test_sampler_logprobs_equal_trainer_forward_bit_for_bit(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-rl") as sc:
        tc = sc.create_lora_training_client(BASE, rank=8, seed=3)
        tc.forward_backward([next_token_datum(PROMPT)], "cross_entropy")
        tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()  # a non-trivial adapter
        sampler = tc.save_weights_and_get_sampling_client("step1")
        res = sampler.sample(lathe.ModelInput.from_ints(PROMPT), 4,
                             lathe.SamplingParams(max_tokens=12, seed=7, stop=[])).result()
        assert len(res.sequences) == 4
        for s in res.sequences:
            assert s.policy_version == sampler.model_path and s.stop_reason == "length" and len(s.tokens) == 12
        data = [rl_datum(PROMPT, s.tokens, s.logprobs, 0.0) for s in res.sequences]
        fwd = tc.forward(data, "importance_sampling").result()
        for s, out in zip(res.sequences, fwd.loss_fn_outputs, strict=True):
            trainer_lp = out["logprobs"].to_numpy()[len(PROMPT) - 1:]
            assert np.array_equal(trainer_lp, np.asarray(s.logprobs, dtype=np.float32))
        # compute_logprobs is the prompt-logprob path of the sampler: also the trainer's numbers
        full = PROMPT + res.sequences[0].tokens
        lp = sampler.compute_logprobs(lathe.ModelInput.from_ints(full)).result()
        assert lp[0] is None
        ce = tc.forward([next_token_datum(full)], "cross_entropy").result()
        assert np.array_equal(np.asarray(lp[1:], dtype=np.float32), ce.loss_fn_outputs[0]["logprobs"].to_numpy())
        # both pools ran their exactness self-check; receipts and capabilities say the bits are comparable
        assert res.receipt.exact and fwd.receipt.exact
        assert res.receipt.fingerprint == fwd.receipt.fingerprint != ""
        model = next(m for m in sc.get_server_capabilities().supported_models if m.model_name == BASE)
        assert model.trainer_exactness.checked and model.trainer_exactness.exact
        assert model.sampler_exactness.checked and model.sampler_exactness.exact
        assert model.trainer_exactness.fingerprint == model.sampler_exactness.fingerprint == res.receipt.fingerprint
        assert model.logprobs_exact


def test_short_rl_run_updates_the_adapter_and_new_sampler_weights_change_samples(stack: Stack) -> None:
    params = lathe.SamplingParams(max_tokens=8, seed=11, stop=[], temperature=1.0)
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-rl") as sc:
        tc = sc.create_lora_training_client(BASE, rank=8, seed=5)
        paths, samples, rewards = [], [], []
        for step in range(6):
            sampler = tc.save_weights_and_get_sampling_client(f"rl-{step}")
            paths.append(sampler.model_path)
            res = sampler.sample(lathe.ModelInput.from_ints(PROMPT), 8, params).result()
            samples.append([s.tokens for s in res.sequences])
            r = np.array([sum(t < 128 for t in s.tokens) for s in res.sequences], dtype=float)  # low token ids
            rewards.append(r.mean())
            adv = r - r.mean()
            data = [rl_datum(PROMPT, s.tokens, s.logprobs, float(a)) for s, a in zip(res.sequences, adv, strict=True)]
            fb = tc.forward_backward(data, "importance_sampling")
            tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
            assert np.isfinite(fb.result().metrics["loss:sum"])
        assert len(set(paths)) == 6
        assert samples[0] != samples[-1], "the same seed must give other samples once the weights changed"
        assert np.mean(rewards[-2:]) > np.mean(rewards[:2]), rewards


def test_sampling_bad_input_and_other_tenants_paths(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-rl") as sc, \
            lathe.ServiceClient(base_url=stack.gateway, api_key="tml-eve") as eve:
        tc = sc.create_lora_training_client(BASE, rank=4)
        sampler = tc.save_weights_and_get_sampling_client("mine")
        prompt = lathe.ModelInput.from_ints(PROMPT)
        with pytest.raises(lathe.InvalidArgument, match="max_tokens"):
            sampler.sample(prompt, 1, lathe.SamplingParams(max_tokens=0)).result()
        with pytest.raises(lathe.InvalidArgument, match="temperature"):
            sampler.sample(prompt, 1, lathe.SamplingParams(max_tokens=2, temperature=-1.0)).result()
        with pytest.raises(lathe.InvalidArgument, match="top_p"):
            sampler.sample(prompt, 1, lathe.SamplingParams(max_tokens=2, top_p=1.5)).result()
        with pytest.raises(lathe.InvalidArgument, match="num_samples"):
            sampler.sample(prompt, 0, lathe.SamplingParams(max_tokens=2)).result()
        with pytest.raises(lathe.InvalidArgument, match="prompt"):
            sampler.sample(lathe.ModelInput.from_ints([]), 1, lathe.SamplingParams(max_tokens=2)).result()
        with pytest.raises(lathe.NotFound):
            eve.create_sampling_client(model_path=sampler.model_path)
        with pytest.raises(lathe.NotFound):
            sc.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/nope")
        ok = sampler.sample(prompt, 2, lathe.SamplingParams(max_tokens=3, seed=1)).result()
        assert len(ok.sequences) == 2


def test_forward_backward_custom_equals_cross_entropy(stack: Stack) -> None:
    import torch

    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(3, 250, 20)]
    w = rng.uniform(0, 1, 19).astype(np.float32)
    data = [next_token_datum(toks, weights=w)]

    def custom(batch: list[lathe.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        weights = torch.tensor(batch[0].loss_fn_inputs["weights"].to_numpy())
        return -(weights * logprobs[0]).sum(), {"custom:sum": 1.0}

    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-custom") as sc:
        a = sc.create_lora_training_client(BASE, rank=4, seed=9)
        b = sc.create_lora_training_client(BASE, rank=4, seed=9)
        for _ in range(2):  # the second round sees a trained adapter (non-zero B)
            ra = a.forward_backward(data, "cross_entropy")
            rb = b.forward_backward_custom(data, custom)
            a.optim_step(lathe.AdamParams(learning_rate=0.02))
            b.optim_step(lathe.AdamParams(learning_rate=0.02)).result()
            assert rb.result().metrics["loss:sum"] == pytest.approx(ra.result().metrics["loss:sum"], rel=1e-5)
            assert rb.result().metrics["custom:sum"] == 1.0
        la = a.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        lb = b.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert np.array_equal(la, lb)  # the same gradients, so the same weights after the same steps
