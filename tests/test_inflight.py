"""Inflight sampling clients (tinker 0.38's ``SamplingClientKind``): every inflight client of a training run follows
the run's latest inflight save, a snapshot client never moves, and each sample runs on one published version, which
Lathe's SDK reports per sequence (``policy_version``)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker

import lathe
from lathe.errors import InvalidArgument
from lathe.stack import Stack
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]
PROBE = PROMPT + [61, 8, 250, 3]


def _train(tc: object, sdk: object, steps: int = 2) -> None:
    datum = next_token_datum(PROMPT, sdk)
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(sdk.AdamParams(learning_rate=0.05)).result()


def test_an_inflight_client_follows_later_inflight_saves_and_a_snapshot_does_not(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-inflight")
    tc = sc.create_lora_training_client(BASE, rank=4, seed=3).result()
    _train(tc, tinker, 1)
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()

    def scored(client: tinker.SamplingClient) -> list[float | None]:
        return client.compute_logprobs(tinker.ModelInput.from_ints(PROBE)).result()

    before = scored(first)
    assert before == scored(snapshot)
    _train(tc, tinker)
    assert scored(first) == before  # trained, not yet published: the inflight weights are the old ones
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    after = scored(second)
    assert after != before
    assert scored(first) == after  # the first inflight client now samples the second save's weights
    assert scored(snapshot) == before  # a snapshot stays where it was
    trainer = tc.forward([tinker.Datum(model_input=tinker.ModelInput.from_ints(PROBE[:-1]),
                                       loss_fn_inputs={"target_tokens": PROBE[1:]})], "cross_entropy").result()
    assert np.array_equal(np.asarray(after[1:], np.float32), trainer.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert first._sampling_session_id != second._sampling_session_id  # each inflight save: a session of its own
    sc.close("success").result()


def test_each_sample_of_an_inflight_client_runs_on_one_version_and_says_which(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-inflight-lathe") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=4)
        client = tc.save_weights_and_get_sampling_client(kind="inflight")
        params = lathe.SamplingParams(max_tokens=24, seed=5, stop=[])
        old = client.sample(lathe.ModelInput.from_ints(PROMPT), 2, params).result()
        assert len({s.policy_version for s in old.sequences}) == 1
        old_path = old.sequences[0].policy_version
        assert old_path.startswith(f"tinker://{tc.model_id}/sampler_weights/")
        racing = client.sample(lathe.ModelInput.from_ints(PROMPT), 2, params)  # in flight while the next save runs
        _train(tc, lathe)
        tc.save_weights_and_get_sampling_client(kind="inflight")
        new = client.sample(lathe.ModelInput.from_ints(PROMPT), 2, params).result()
        new_path = new.sequences[0].policy_version
        assert new_path != old_path and {s.policy_version for s in new.sequences} == {new_path}
        for res in (old, racing.result(), new):
            version = {s.policy_version for s in res.sequences} | {res.receipt.policy}
            assert len(version) == 1 and version <= {old_path, new_path}  # one version per request, named
            pinned = sc.create_sampling_client(version.pop())  # a snapshot of that version scores the same bits
            for seq in res.sequences:
                lps = pinned.compute_logprobs(lathe.ModelInput.from_ints(PROMPT + seq.tokens)).result()
                assert lps[len(PROMPT):] == seq.logprobs


def test_inflight_saves_are_unnamed_and_kinds_are_named(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-inflight-bad") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=4)
        with pytest.raises(InvalidArgument, match="kind = 'inflight' publishes unnamed weights: drop name 'mine'"):
            tc.save_weights_and_get_sampling_client("mine", kind="inflight")
        with pytest.raises(InvalidArgument, match="kind = 'live': a sampling client is 'snapshot'"):
            tc.save_weights_and_get_sampling_client(kind="live")
        tc.forward_backward([lathe.Datum(model_input=lathe.ModelInput.from_ints(PROMPT[:-1]),
                                         loss_fn_inputs={"target_tokens": PROMPT[1:]})], "cross_entropy"
                            ).result()  # the refusals took no seq_id: the client still trains
