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
    if name in ("ppo", "gspo"):
        if name == "gspo":  # every token carries the sequence ratio; d r_t / d lp_t = r_t
            marked = inp["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inp else a != 0
            r = np.full_like(lp, np.exp(np.mean((lp - q)[marked])) if marked.any() else 1.0)
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        clipped = np.clip(r, lo, hi)
        use_unclipped = r * a <= clipped * a
        value = -np.where(use_unclipped, r * a, clipped * a).sum()
        inside = (r > lo) & (r < hi)
        grad = -np.where(use_unclipped, r * a, np.where(inside, r * a, 0.0))
        return float(value), grad
    if name in ("cispo", "stable_reinforce"):
        c = np.clip(r, cfg.get("clip_low_threshold", -np.inf), cfg["clip_high_threshold"])
        k, sampled = cfg.get("kl_coeff", 0.0), q != 0  # KL(behaviour || trained) on the sampled tokens
        d = lp - q
        penalty = k * ((np.exp(d) - 1 - d) * sampled).sum()
        return float(-(c * lp * a).sum() + penalty), -c * a + k * np.expm1(d) * sampled
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
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("stable_reinforce", {}),
    ("stable_reinforce", {"clip_high_threshold": 1.1}),
    ("stable_reinforce", {"kl_coeff": 0.3}),
]


def _inputs(rng: np.random.Generator, n: int, names: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Target logprobs and the loss's inputs, with ratios spread across (and, for the first five tokens,
    exactly on) the default and overridden clip edges."""
    lp = -rng.exponential(1.0, n)
    q = lp + rng.normal(0, 0.4, n)
    q[:5] = lp[:5] - np.log([0.8, 1.2, 0.5, 1.5, 4.0])
    inp = {"weights": rng.uniform(-1, 2, n), "logprobs": q, "advantages": rng.normal(0, 1, n),
           "sequence_ratio_mask": (rng.uniform(0, 1, n) < 0.7).astype(np.float64)}
    return lp, {k: v for k, v in inp.items() if k in names}


def _check(name: str, lp: np.ndarray, inp: dict[str, np.ndarray], cfg: dict[str, float], edges: slice) -> None:
    lp_t = torch.tensor(lp, requires_grad=True)
    loss = LOSSES[name].fn(lp_t, {k: torch.tensor(v) for k, v in inp.items()}, cfg)
    loss.backward()
    ref_value, ref_grad = _ref(name, lp, inp, cfg)
    assert float(loss.detach()) == pytest.approx(ref_value, rel=1e-12)
    np.testing.assert_allclose(lp_t.grad.numpy()[edges], ref_grad[edges], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,override", CASES)
def test_loss_value_and_gradient_match_reference(name: str, override: dict[str, float]) -> None:
    spec = LOSSES[name]
    lp, inp = _inputs(np.random.default_rng(0), 257, spec.inputs + spec.optional)
    kinks = name in ("ppo", "cispo", "stable_reinforce")  # at a clip edge any subgradient is fine
    _check(name, lp, inp, {**spec.config, **override}, slice(5, None) if kinks else slice(None))


@pytest.mark.parametrize("case", ["masked", "unmasked", "nothing marked", "on policy"])
def test_gspo_takes_one_ratio_per_sequence_over_the_marked_tokens(case: str) -> None:
    """The ratio is the geometric mean over ``sequence_ratio_mask``'s tokens (without it: those with an
    advantage); prompt rows padded with q = 0 must not enter it. Wide thresholds so the clip lets it through."""
    rng = np.random.default_rng(1)
    lp, inp = _inputs(rng, 40, ("logprobs", "advantages", "sequence_ratio_mask"))
    inp["logprobs"][:10], inp["advantages"][:10], inp["sequence_ratio_mask"][:10] = 0.0, 0.0, 0.0  # a prompt
    if case != "masked":
        del inp["sequence_ratio_mask"]
    if case == "nothing marked":
        inp["advantages"][:] = 0.0
    if case == "on policy":
        inp["logprobs"][10:] = lp[10:]
    cfg = {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}
    _check("gspo", lp, inp, cfg, slice(None))
    if case == "on policy":  # ratio 1: the gradient is plain REINFORCE's
        lp_t = torch.tensor(lp, requires_grad=True)
        LOSSES["gspo"].fn(lp_t, {k: torch.tensor(v) for k, v in inp.items()}, cfg).backward()
        np.testing.assert_array_equal(lp_t.grad.numpy(), -inp["advantages"])


def test_defaults_are_tinkers() -> None:
    assert LOSSES["ppo"].config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert LOSSES["cispo"].config == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert LOSSES["dro"].config == {"beta": 0.05}
    assert LOSSES["gspo"].config == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    assert LOSSES["stable_reinforce"].config == {"clip_high_threshold": 2.0, "kl_coeff": 0.0}
