"""The official ``tinker`` SDK (0.38.0), unchanged, against Lathe's HTTP door, in lockstep with Lathe's own SDK
(gRPC door) on the same data: both must see the same losses, logprobs and samples, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from types import ModuleType

import numpy as np
import pytest
import tinker
import torch

import lathe
from lathe.stack import Stack
from tests.helpers import next_token_datum, rl_datum

BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]
SAMPLING = {"max_tokens": 8, "seed": 11, "stop": []}




def sft_data(sdk: ModuleType, seed: int = 0, n: int = 4, length: tuple[int, int] = (12, 24)) -> list:
    """``n`` random next-token datums built with ``sdk`` (``tinker`` or ``lathe``): the same values either way."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = [rng.randrange(3, 500) for _ in range(rng.randrange(*length))]
        weights = [0.0] * 2 + [rng.choice([0.5, 1.0]) for _ in toks[3:]]
        out.append(next_token_datum(toks, sdk, weights))
    return out


def rl_data(sdk: ModuleType, seed: int = 1) -> list:
    """Random RL datums; built with ``tinker``, each names a (made-up) sampled sequence as its provenance."""
    rng = random.Random(seed)
    out = []
    for i in range(3):
        toks = [rng.randrange(3, 500) for _ in range(10)]
        datum = sdk.Datum(model_input=sdk.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
            "target_tokens": toks[1:], "logprobs": [-rng.uniform(3, 8) for _ in toks[1:]],
            "advantages": [rng.uniform(-1, 1) for _ in toks[1:]]})
        if sdk is tinker:
            run = [tinker.SampledProvenanceSpan(sequence_id=f"s{seed}:{i}", length=len(toks) - 1)]
            datum = datum.with_provenance(model_input=run, loss_fn_inputs=run)
        out.append(datum)
    return out


def sampled_data(sdk: ModuleType, sequences: list, advantages: list[float]) -> list:
    """Datums for sampled ``sequences`` of ``PROMPT`` as the cookbook builds them: prompt rows carry no logprob
    and no advantage; built with ``tinker``, they name their sampled sequence (``Datum.with_provenance``)."""
    out = []
    for seq, adv in zip(sequences, advantages, strict=True):
        prompt = len(PROMPT) - 1
        datum = rl_datum(PROMPT, seq.tokens, seq.logprobs, adv, sdk)
        if sdk is tinker:
            datum = datum.with_provenance(
                model_input=[tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(PROMPT)),
                             tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
                loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=prompt),
                                tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])
        out.append(datum)
    return out


def logprobs(out: object) -> list[list[float]]:
    return [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs]


def step(tc: object, sdk: ModuleType, data: list, loss_fn: str) -> object:
    fb = tc.forward_backward(data, loss_fn)
    tc.optim_step(sdk.AdamParams(learning_rate=0.02)).result()
    return fb.result()


def squared_logprob_loss(data: list, lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    loss = sum((lp ** 2).sum() for lp in lps)
    return loss, {"custom:sum": float(loss.detach())}


def same(a: object, b: object) -> None:
    """Two ForwardBackwardOutputs with equal loss and per-datum logprobs."""
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    assert logprobs(a) == logprobs(b)


def test_the_official_sdk_flow_matches_lathes_sdk(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-flow", user_metadata={"who": "test"})
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-flow")
    t = sc.create_lora_training_client(BASE, rank=8, seed=1, user_metadata={"renderer_name": "role_colon"}).result()
    lt = lc.create_lora_training_client(BASE, rank=8, seed=1)
    session = t.model_id.split(":")[0]
    assert t.model_id == f"{session}:train:0"
    info = t.get_info()
    assert (info.model_data.model_name, info.lora_rank) == (BASE, 8)

    # training: every loss kind, a forward, a custom loss
    same(step(t, tinker, sft_data(tinker), "cross_entropy"), step(lt, lathe, sft_data(lathe), "cross_entropy"))
    same(step(t, tinker, rl_data(tinker), "importance_sampling"),
         step(lt, lathe, rl_data(lathe), "importance_sampling"))
    same(t.forward(sft_data(tinker, 2), "cross_entropy").result(), lt.forward(sft_data(lathe, 2)).result())
    custom_t = t.forward_backward_custom(sft_data(tinker, 3), squared_logprob_loss)
    custom_l = lt.forward_backward_custom(sft_data(lathe, 3), squared_logprob_loss)
    assert custom_t.result().metrics["loss:sum"] == custom_l.result().metrics["loss:sum"]
    assert custom_t.result().metrics["custom:sum"] == custom_t.result().metrics["loss:sum"]
    t.optim_step(tinker.AdamParams(learning_rate=0.02)).result()
    lt.optim_step(lathe.AdamParams(learning_rate=0.02)).result()
    same(t.forward(sft_data(tinker, 4), "cross_entropy").result(), lt.forward(sft_data(lathe, 4)).result())

    # sampling from the trained adapter: both SDKs, the same seeded tokens and logprobs
    ts = t.save_weights_and_get_sampling_client().result()
    ls = lt.save_weights_and_get_sampling_client()
    res = ts.sample(tinker.ModelInput.from_ints(PROMPT), 3, tinker.SamplingParams(**SAMPLING)).result()
    ref = ls.sample(lathe.ModelInput.from_ints(PROMPT), 3, lathe.SamplingParams(**SAMPLING)).result()
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences] == \
        [(s.tokens, s.logprobs, s.stop_reason) for s in ref.sequences]
    assert len({s.sequence_id for s in res.sequences}) == 3 and len({tuple(s.tokens) for s in res.sequences}) > 1
    with_prompt = {"include_prompt_logprobs": True, "topk_prompt_logprobs": 3}
    scored = ts.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(**SAMPLING), **with_prompt)
    ref_scored = ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(**SAMPLING), **with_prompt)
    assert scored.result().prompt_logprobs == ref_scored.result().prompt_logprobs
    assert scored.result().topk_prompt_logprobs == ref_scored.result().topk_prompt_logprobs
    assert scored.result().topk_prompt_logprobs[0] is None and len(scored.result().topk_prompt_logprobs[1]) == 3
    full = PROMPT + res.sequences[0].tokens
    lps = ts.compute_logprobs(tinker.ModelInput.from_ints(full)).result()
    assert lps == ls.compute_logprobs(lathe.ModelInput.from_ints(full)).result() and lps[0] is None
    on_policy = t.forward([tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]),
                                        loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()
    assert np.array_equal(np.asarray(lps[1:], np.float32), on_policy.loss_fn_outputs[0]["logprobs"].to_numpy())

    # a named sampler checkpoint serves the same policy
    sampler_path = t.save_weights_for_sampler("named", ttl_seconds=7200).result().path
    assert sampler_path == f"tinker://{t.model_id}/sampler_weights/named"
    named = sc.create_sampling_client(model_path=sampler_path).result()
    again = named.sample(tinker.ModelInput.from_ints(PROMPT), 3, tinker.SamplingParams(**SAMPLING)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]

    # save, move on, load back (legacy load_state), and start a new run from the same state
    state = t.save_state("ckpt", user_metadata={"stage": "sft"}).result().path
    at_state = t.forward(sft_data(tinker, 5), "cross_entropy").result()
    step(t, tinker, sft_data(tinker, 6), "cross_entropy")
    with pytest.warns(FutureWarning):
        t.load_state_with_optimizer(state).result()
    same(t.forward(sft_data(tinker, 5), "cross_entropy").result(), at_state)
    t2 = sc.create_training_client_from_state_with_optimizer(state).result()
    assert t2.model_id == f"{session}:train:1"
    same(step(t2, tinker, sft_data(tinker, 6), "cross_entropy"), step(t, tinker, sft_data(tinker, 6), "cross_entropy"))

    # the registry
    rc = tinker.RestClient(base_url=stack.http_url, api_key="tml-flow")
    assert {t.model_id, t2.model_id} <= {r.training_run_id for r in rc.list_training_runs().result().training_runs}
    run = rc.get_training_run_by_tinker_path(state).result()
    assert run.user_metadata == {"renderer_name": "role_colon"} and run.last_checkpoint.tinker_path == state
    listed = {c.checkpoint_id: c for c in rc.list_checkpoints(t.model_id).result().checkpoints}
    assert listed["weights/ckpt"].expires_at is None and listed["weights/ckpt"].checkpoint_type == "training"
    assert listed["weights/ckpt"].user_metadata == {"stage": "sft"}
    assert listed["sampler_weights/named"].expires_at is not None
    weights = rc.get_weights_info_by_tinker_path(state).result()
    assert (weights.base_model, weights.is_lora, weights.lora_rank) == (BASE, True, 8)
    assert rc.get_sampler(named._sampling_session_id).result().model_path == sampler_path
    rc.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert sampler_path not in {c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints}
    assert state in {c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints}
    sc.close("success").result()
    lc.close()


@pytest.mark.parametrize(("loss_fn", "config", "other"), [
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"clip_low_threshold": 0.5}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, {"clip_high_threshold": 0.5}),
    ("dro", {"beta": 0.1}, {"beta": 2.0}),
    ("gspo", {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}, {}),
])  # stable_reinforce trains on recorded samples only: test_stable_reinforce_trains_on_recorded_samples
def test_every_trainer_loss_and_its_config_reach_the_trainer(stack: Stack, loss_fn: str, config: dict,
                                                             other: dict) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-losses")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-losses")
    t = sc.create_lora_training_client(BASE, rank=4, seed=4).result()
    lt = lc.create_lora_training_client(BASE, rank=4, seed=4)
    out = t.forward(rl_data(tinker), loss_fn, config).result()
    same(out, lt.forward(rl_data(lathe), loss_fn, config).result())
    assert t.forward(rl_data(tinker), loss_fn, other).result().metrics["loss:sum"] != out.metrics["loss:sum"]
    sc.close("success").result()
    lc.close()


def test_stable_reinforce_trains_on_recorded_samples(stack: Stack) -> None:
    """Sampled with ``record_stability_info``, the cookbook's datums train the same through both SDKs, on the
    recorded behaviour logprobs (whatever logprobs a datum carries), and its clip threshold reaches the trainer; a
    datum without provenance, naming a sequence never recorded, or whose tokens are not the recorded ones is
    refused by name."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-stable")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-stable")
    t = sc.create_lora_training_client(BASE, rank=4, seed=5).result()
    lt = lc.create_lora_training_client(BASE, rank=4, seed=5)
    ts = t.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = ts.sample(tinker.ModelInput.from_ints(PROMPT), 2, tinker.SamplingParams(**SAMPLING)).result().sequences
    advantages = [1.0, -1.0]
    data = sampled_data(tinker, sequences, advantages)
    on_policy = t.forward(data, "stable_reinforce").result().metrics["loss:sum"]
    assert t.forward(data, "stable_reinforce", {"clip_high_threshold": 0.5}).result().metrics["loss:sum"] == \
        pytest.approx(0.5 * on_policy, rel=1e-6)  # on policy the ratio is 1: clipped at 0.5, the loss halves
    zeroed = [dataclasses.replace(d, loss_fn_inputs={**d.loss_fn_inputs, "logprobs": tinker.TensorData.from_numpy(
        np.zeros(len(d.loss_fn_inputs["target_tokens"].data), np.float32))}) for d in data]
    assert t.forward(zeroed, "stable_reinforce").result().metrics["loss:sum"] == on_policy  # the record's, not these
    for bad, message in (
            (_with_target(data[0], -1, 7), r"data\[0\]\.loss_fn_inputs\['target_tokens'\]\[\d+\] = 7, but .* recorded "
                                           r"\d+ at sampled_tokens\[\d+\] .*re-tokenized"),
            (sampled_data(tinker, [dataclasses.replace(sequences[0], sequence_id="never:0")], [1.0])[0],
             r"sequence_id 'never:0' has no record"),
            (_shifted(data[0], sequences[0]),
             r"loss_fn_input_spans\[1\]: sampled_tokens \[1, \d+\) of .* runs past its \d+ recorded tokens"),
            (dataclasses.replace(data[0], loss_fn_inputs={**data[0].loss_fn_inputs, "advantages": tinker.TensorData(
                data=[0.5] * len(data[0].loss_fn_inputs["advantages"].data), dtype="float32",
                shape=[len(data[0].loss_fn_inputs["advantages"].data)])}),
             r"advantages'\]\[0\] = 0\.5 is on a prompt token")):
        with pytest.raises(tinker.BadRequestError, match=message):
            t.forward([bad], "stable_reinforce").result()
    out = step(t, tinker, sampled_data(tinker, sequences, advantages), "stable_reinforce")
    moved = t.forward(data, "stable_reinforce").result().metrics["loss:sum"]  # off policy now: kl_coeff matters
    assert t.forward(data, "stable_reinforce", {"kl_coeff": 1.0}).result().metrics["loss:sum"] > moved
    same(out, step(lt, lathe, sampled_data(lathe, sequences, advantages), "stable_reinforce"))
    # on policy the recorded logprobs are the trainer's, bit for bit: every weight is 1, the loss REINFORCE's
    sampled = [np.asarray(lp)[len(PROMPT) - 1:] for lp in logprobs(out)]
    assert [lp.tolist() for lp in sampled] == [np.asarray(s.logprobs, np.float32).tolist() for s in sequences]
    reinforce = -sum(a * float(lp.astype(np.float64).sum()) for a, lp in zip(advantages, sampled, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(reinforce, rel=1e-5)
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\] has no provenance"):
        bare = [dataclasses.replace(d, model_input_spans=None, loss_fn_input_spans=None)
                for d in sampled_data(tinker, sequences, advantages)]
        t.forward_backward(bare, "stable_reinforce").result()
    sc.close("success").result()
    lc.close()


def _shifted(datum: tinker.Datum, seq: tinker.SampledSequence) -> tinker.Datum:
    """``datum`` whose loss-input run of sampled tokens starts one token late: it still tiles its field, but runs
    past the end of the sequence's record."""
    runs = [tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(PROMPT) - 1),
            tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(seq.tokens))]
    return dataclasses.replace(datum, loss_fn_input_spans=runs)


def _with_target(datum: tinker.Datum, position: int, token: int) -> tinker.Datum:
    targets = list(datum.loss_fn_inputs["target_tokens"].data)
    targets[position] = token
    return dataclasses.replace(datum, loss_fn_inputs={**datum.loss_fn_inputs, "target_tokens":
                                                      tinker.TensorData(data=targets, dtype="int64",
                                                                        shape=[len(targets)])})


def test_lora_config_reaches_the_trainer(stack: Stack) -> None:
    """Adapters on fewer modules train differently; the flags come back from weights_info."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-lora")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-lora")
    flags = {"train_mlp": True, "train_attn": False, "train_unembed": False}
    t = sc.create_lora_training_client(BASE, rank=4, seed=6, **flags).result()
    narrow = lc.create_lora_training_client(BASE, rank=4, seed=6, **flags)
    full = lc.create_lora_training_client(BASE, rank=4, seed=6)

    def after_a_step(client: object, sdk: ModuleType) -> object:
        step(client, sdk, sft_data(sdk), "cross_entropy")
        return client.forward(sft_data(sdk, 1), "cross_entropy").result()

    outs = [after_a_step(c, sdk) for c, sdk in ((t, tinker), (narrow, lathe), (full, lathe))]
    same(outs[0], outs[1])
    assert logprobs(outs[0]) != logprobs(outs[2])
    info = tinker.RestClient(base_url=stack.http_url, api_key="tml-lora").get_weights_info_by_tinker_path(
        t.save_state("flags").result().path).result()
    assert (info.lora_rank, info.train_mlp, info.train_attn, info.train_unembed) == (4, True, False, False)
    sc.close("success").result()
    lc.close()


def test_a_batch_the_sdk_splits_equals_it_unsplit(stack: Stack) -> None:
    """Over 1024 datums the SDK sends chunks 2..n first and chunk 1 last; the trainer runs them in order."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-chunks")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-chunks")
    t = sc.create_lora_training_client(BASE, rank=4, seed=2).result()
    lt = lc.create_lora_training_client(BASE, rank=4, seed=2)
    data_t, data_l = sft_data(tinker, 7, n=1100, length=(4, 8)), sft_data(lathe, 7, n=1100, length=(4, 8))
    assert len(data_t) > t.holder.get_client_config().fwdbwd_max_chunk_len
    split, whole = step(t, tinker, data_t, "cross_entropy"), step(lt, lathe, data_l, "cross_entropy")
    assert logprobs(split) == logprobs(whole)  # each datum's logprobs do not depend on the batch
    assert split.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-6)
    after_t, after_l = t.forward(sft_data(tinker, 8), "cross_entropy").result(), lt.forward(sft_data(lathe, 8)).result()
    np.testing.assert_allclose(np.concatenate(logprobs(after_t)), np.concatenate(logprobs(after_l)), rtol=1e-5)
    sc.close("success").result()
    lc.close()


def test_sdk_errors_are_the_ones_its_users_catch(stack: Stack) -> None:
    alice = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-err-alice")
    bob = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-err-bob")
    with pytest.raises(tinker.BadRequestError, match="unknown base_model 'no/such-model'"):
        alice.create_lora_training_client("no/such-model", rank=4).result()
    path = alice.create_lora_training_client(BASE, rank=4).result().save_weights_for_sampler("mine").result().path
    with pytest.raises(tinker.NotFoundError, match="not found"):
        bob.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.TinkerError, match="tml-"):
        tinker.ServiceClient(base_url=stack.http_url, api_key="dummy").create_lora_training_client(BASE).result()
    alice.close("success").result()
    bob.close("success").result()


def test_the_tinker_cli_lists_runs_and_checkpoints(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-cli")
    tc = sc.create_lora_training_client(BASE, rank=4).result()
    path = tc.save_state("cli-ckpt").result().path
    sc.close("success").result()
    env = {**os.environ, "TINKER_BASE_URL": stack.http_url, "TINKER_API_KEY": "tml-cli", "TINKER_TELEMETRY": "0"}

    def cli(*args: str) -> object:
        out = subprocess.run([sys.executable, "-m", "tinker.cli", "--format", "json", *args], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert tc.model_id in json.dumps(cli("run", "list"))
    assert path in json.dumps(cli("checkpoint", "list"))
    assert re.search(r"weights/cli-ckpt", json.dumps(cli("checkpoint", "list", "--run-id", tc.model_id)))
