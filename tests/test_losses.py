"""Each loss against a hand-written float64 reference: value and gradient with respect to logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lathe.trainer.losses import LOSSES


def _ref(name: str, lp: np.ndarray, inp: dict[str, np.ndarray], cfg: dict[str, float]) -> tuple[float, np.ndarray]:
    """(loss, dloss/dlp) written out by hand."""
    if name == "cross_entropy":
        return float(-(inp["weights"] * lp).sum()), -inp["weights"]
    q, a = inp["logprobs"], inp["advantages"]
    r = np.exp(lp - q)
    if name == "importance_sampling":
        return float(-(r * a).sum()), -r * a
    if name == "ppo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        clipped = np.clip(r, lo, hi)
        use_unclipped = r * a <= clipped * a
        value = -np.where(use_unclipped, r * a, clipped * a).sum()
        inside = (r > lo) & (r < hi)
        grad = -np.where(use_unclipped, r * a, np.where(inside, r * a, 0.0))
        return float(value), grad
    if name == "cispo":
        c = np.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return float(-(c * lp * a).sum()), -c * a
    beta = cfg["beta"]
    return float(-(lp * a - 0.5 * beta * (lp - q) ** 2).sum()), -(a - beta * (lp - q))


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {}),
    ("dro", {"beta": 0.7}),
]


@pytest.mark.parametrize("name,override", CASES)
def test_loss_value_and_gradient_match_reference(name: str, override: dict[str, float]) -> None:
    spec = LOSSES[name]
    cfg = {**spec.config, **override}
    rng = np.random.default_rng(0)
    n = 257
    lp = -rng.exponential(1.0, n)
    q = lp + rng.normal(0, 0.4, n)  # ratios spread across the clip edges
    q[:5] = lp[:5] - np.log([0.8, 1.2, 0.5, 1.5, 4.0])  # ratios exactly on default and overridden edges
    inp = {"weights": rng.uniform(-1, 2, n), "logprobs": q, "advantages": rng.normal(0, 1, n)}
    inp = {k: v for k, v in inp.items() if k in spec.inputs}
    lp_t = torch.tensor(lp, requires_grad=True)
    loss = spec.fn(lp_t, {k: torch.tensor(v) for k, v in inp.items()}, cfg)
    loss.backward()
    ref_value, ref_grad = _ref(name, lp, inp, cfg)
    assert float(loss.detach()) == pytest.approx(ref_value, rel=1e-12)
    edges = slice(5, None) if name in ("ppo", "cispo") else slice(None)  # kinks: any subgradient is fine
    np.testing.assert_allclose(lp_t.grad.numpy()[edges], ref_grad[edges], rtol=1e-12, atol=1e-12)


def test_defaults_are_tinkers() -> None:
    assert LOSSES["ppo"].config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert LOSSES["cispo"].config == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert LOSSES["dro"].config == {"beta": 0.05}
