"""Dimuon: the trainer's fp32 step against a float64 reference written from the same description (matrix sign by
SVD, not by iteration), and Dimuon runs through both SDKs, bit for bit, with the momentum kept across a resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import torch

import lathe
from lathe.stack import Stack
from lathe.trainer.dimuon import DAMPING, DimuonState, dimuon_step
from lathe.types import DimuonParams
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"


def ref_step(p: dict[str, np.ndarray], g: dict[str, np.ndarray], m: dict[str, np.ndarray], hp: DimuonParams
             ) -> None:
    """One Dimuon step in float64, in place: clip, momentum, damped row/column preconditioning, U V^T of the
    SVD, scaled to Frobenius norm sqrt(rank)."""
    norm = math.sqrt(sum(float((x ** 2).sum()) for x in g.values()))
    scale = hp.grad_clip_norm / (norm + 1e-6) if 0 < hp.grad_clip_norm < norm else 1.0
    for n in p:
        m[n] = hp.beta1 * m[n] + (1 - hp.beta1) * scale * g[n]
        row = (m[n] ** 2).mean(axis=1, keepdims=True)
        col = (m[n] ** 2).mean(axis=0, keepdims=True)
        pre = m[n] / ((row + DAMPING * row.mean()) ** 0.25 * (col + DAMPING * col.mean()) ** 0.25)
        u, _, vt = np.linalg.svd(pre, full_matrices=False)
        sign = u @ vt
        p[n] = p[n] - hp.learning_rate * sign * math.sqrt(min(sign.shape)) / np.linalg.norm(sign)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_dimuon_step_matches_a_float64_reference(clip: float) -> None:
    rng = np.random.default_rng(7)
    shapes = {"lora_A": (4, 16), "lora_B": (24, 4)}
    p64 = {n: rng.normal(0, 0.1, s) for n, s in shapes.items()}
    m64 = {n: np.zeros(s) for n, s in shapes.items()}
    params = {n: torch.tensor(v, dtype=torch.float32) for n, v in p64.items()}
    state = DimuonState.zeros(params)
    hp = DimuonParams(learning_rate=0.03, grad_clip_norm=clip, beta1=0.8)
    for _ in range(3):
        grads = {n: rng.normal(0, 1, s) for n, s in shapes.items()}
        for n, t in params.items():
            t.grad = torch.tensor(grads[n], dtype=torch.float32)
        before = {n: t.clone() for n, t in params.items()}
        metrics = dimuon_step(params, state, hp)
        ref_step(p64, grads, m64, hp)
        for n, t in params.items():
            np.testing.assert_allclose(t.numpy(), p64[n], rtol=1e-4, atol=2e-6)
            step_norm = float(torch.linalg.matrix_norm(t - before[n])) / hp.learning_rate
            assert abs(step_norm - 2.0) < 1e-3  # sqrt(rank 4)
            assert t.grad is None
    assert metrics["step:max"] == 3.0 and metrics["learning_rate:mean"] == 0.03


def test_a_zero_momentum_makes_no_step() -> None:
    params = {"a": torch.ones(4, 8)}
    dimuon_step(params, DimuonState.zeros(params), DimuonParams(learning_rate=1.0))
    assert torch.equal(params["a"], torch.ones(4, 8))


def _data(sdk) -> list:  # noqa: ANN001 - tinker or lathe
    rng = np.random.default_rng(2)
    out = []
    for _ in range(3):
        toks = rng.integers(3, 500, 14).tolist()
        out.append(next_token_datum(toks, sdk))
    return out


def _train(tc, sdk, steps: int) -> list[float]:  # noqa: ANN001
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(_data(sdk), "cross_entropy")
        tc.optim_step(sdk.DimuonParams(learning_rate=0.02, beta1=0.9)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_dimuon_runs_train_alike_through_both_sdks_and_resume_with_their_momentum(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-dimuon")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-dimuon")
    t = sc.create_lora_training_client(BASE, rank=4, seed=6, optimizer=tinker.DimuonOptimizerConfig()).result()
    lt = lc.create_lora_training_client(BASE, rank=4, seed=6, optimizer=lathe.DimuonOptimizerConfig())
    theirs, ours = _train(t, tinker, 3), _train(lt, lathe, 3)
    assert theirs == ours and theirs[2] < theirs[0]
    with pytest.raises(tinker.RequestFailedError, match="created with optimizer 'dimuon'; AdamParams belong to"):
        t.optim_step(tinker.AdamParams(learning_rate=0.01)).result()
    path = t.save_state("d3").result().path
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    fresh_momentum = sc.create_training_client_from_state(path, optimizer=tinker.DimuonOptimizerConfig()).result()
    continued, with_state, without = _train(lt, lathe, 2), _train(resumed, tinker, 2), _train(fresh_momentum, tinker, 2)
    assert with_state == continued  # momentum and step count came back with the state
    assert without[0] == continued[0] and without[1] != continued[1]  # same weights, momentum started over
    sc.close("success").result()
    lc.close()
