"""End to end across real processes: checkpoints, trainer and gateway on loopback, driven by the SDK."""

from __future__ import annotations

import random

import numpy as np
import pytest

import lathe
from lathe.stack import Stack
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"


def sft_batch(seed: int = 0, n: int = 4) -> list[lathe.Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = [rng.randrange(3, 250) for _ in range(rng.randrange(12, 24))]
        weights = [0.0] * 4 + [1.0] * (len(toks) - 5)
        out.append(next_token_datum(toks, weights=weights))
    return out


def logprobs(out: lathe.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def step(tc: lathe.TrainingClient, data: list[lathe.Datum], lr: float = 5e-3) -> float:
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(lathe.AdamParams(learning_rate=lr))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def test_sft_loss_falls_and_restart_from_state_continues_exactly(stack: Stack) -> None:
    data = sft_batch()
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-alice") as sc:
        caps = sc.get_server_capabilities()
        assert BASE in [m.model_name for m in caps.supported_models]
        tc = sc.create_lora_training_client(BASE, rank=8, seed=1)
        losses = [step(tc, data) for _ in range(21)][1:]  # (cycle packing is tests/test_trainer_engine.py's)
        assert losses[-1] < 0.5 * losses[0], losses
        path = tc.save_state("after-20", user_metadata={"step": "20"}).result().path
        assert path == f"tinker://{tc.model_id}/weights/after-20"
        cont_loss = step(tc, data)
        cont_lp = logprobs(tc.forward(data, "cross_entropy").result())

        tc2 = sc.create_training_client_from_state_with_optimizer(path)
        assert tc2.model_id != tc.model_id
        assert step(tc2, data) == cont_loss
        for a, b in zip(cont_lp, logprobs(tc2.forward(data, "cross_entropy").result()), strict=True):
            assert np.array_equal(a, b)

        tc3 = sc.create_training_client_from_state(path)  # weights only: optimizer starts over
        assert step(tc3, data) == cont_loss  # the same weights give the same loss ...
        lp3 = logprobs(tc3.forward(data, "cross_entropy").result())
        assert any(not np.array_equal(a, b) for a, b in zip(cont_lp, lp3, strict=True))  # ... but a fresh Adam

        rest = sc.create_rest_client()
        runs = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        assert {tc.model_id, tc2.model_id, tc3.model_id} <= set(runs)
        ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert [c.tinker_path for c in ckpts] == [path]
        assert ckpts[0].user_metadata == {"step": "20"}


def test_tenants_are_isolated(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-alice") as alice, \
            lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bob") as bob:
        tc = alice.create_lora_training_client(BASE, rank=4)
        path = tc.save_state("mine").result().path
        assert tc.model_id not in [r.training_run_id for r in bob.create_rest_client().list_training_runs().result()
                                   .training_runs]
        with pytest.raises(lathe.LatheError) as e:
            bob.create_training_client_from_state(path)
        assert path in str(e.value)


def test_unknown_base_model_and_bad_rank(stack: Stack) -> None:
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-carol") as sc:
        with pytest.raises(lathe.InvalidArgument, match="unknown base_model 'no/such-model'"):
            sc.create_lora_training_client("no/such-model", rank=4)
        with pytest.raises(lathe.InvalidArgument, match="rank = 0"):
            sc.create_lora_training_client(BASE, rank=0)
