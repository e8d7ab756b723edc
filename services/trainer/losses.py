"""Tinker's loss functions, one datum at a time.

Every loss is a plain sum over the datum's target tokens (Tinker's convention: no mean, the client
chooses the weighting). Inputs per datum, all shaped like ``target_tokens [L]``:

    cross_entropy        weights w                      loss = -(w * lp).sum()
    importance_sampling  logprobs q, advantages A       loss = -(exp(lp - q) * A).sum()
    ppo                  q, A; clip (lo, hi)=(0.8, 1.2)  r = exp(lp - q)
                                                        loss = -min(r * A, clip(r, lo, hi) * A).sum()
    cispo                q, A; clip (lo, hi)=(0.0, 4.0)  loss = -(sg(clip(r, lo, hi)) * lp * A).sum()
    dro                  q, A; beta=0.05                loss = -(lp * A - beta/2 * (lp - q)^2).sum()
    gspo                 q, A, [sequence_ratio_mask m];  s = exp(mean over M of sg(lp) - q), M = {t: m_t != 0}
                         clip (lo, hi)=(1-3e-4, 1+4e-4)  r_t = s * exp(lp_t - sg(lp_t))  (value s, gradient r_t)
                                                        loss = -min(r * A, clip(r, lo, hi) * A).sum()
    stable_reinforce     q, A; clip_high c=2.0,          loss = -(sg(min(r, c)) * lp * A).sum()
                         kl_coeff k=0                         + k * (exp(d) - 1 - d)[q != 0].sum(),  d = lp - q

``lp`` are the trainer's logprobs of the target tokens; ``sg`` is stop-gradient. Thresholds and beta
are overridable through ``loss_fn_config`` (``clip_low_threshold``, ``clip_high_threshold``, ``beta``).

``gspo`` is Tinker's GSPO-token (its losses page, after Zheng et al. 2025): one sequence-level ratio, the
geometric mean of the token ratios over the tokens ``sequence_ratio_mask`` marks, carried by every token with
its own logprob's gradient, then clipped as in PPO. Our reading where the page is silent: without a
``sequence_ratio_mask`` the ratio is taken over the tokens with a non-zero advantage (the sampled tokens of
a cookbook datum, whose prompt rows carry ``q = 0``); when no token is marked the ratio is 1; the default
thresholds are the GSPO paper's clipping ranges (3e-4 below, 4e-4 above).

``stable_reinforce`` is our reading of Tinker's StableReinforce, whose published description we could read
only in outline (a REINFORCE variant stable when the sampler's policy or numerics differ from the trainer's,
using information recorded at sampling time): the REINFORCE gradient ``A * d lp`` weighted per token by the
importance ratio against the sampling policy, detached and truncated at ``c`` (truncated importance
sampling, Yao et al. 2025, whose C = 2 is the default). ``q`` here is the recorded behaviour logprob: the Tinker
door fills it from the gateway's record of each sampled sequence (``lathe.gateway.stability``), and Lathe's
sampler and trainer compute it bit for bit alike, so the ratio is 1 until the policy moves. ``kl_coeff`` (named by
tinker's SDK for StableReinforce, defined nowhere we could read) is our reading too: a penalty on the KL from the
behaviour policy to the trained one, estimated on the sampled tokens (``q != 0``, as ``metrics.sampler_kl``) with
the non-negative estimator ``exp(d) - 1 - d`` that the trainer's sampler-KL metric uses; 0 (off) by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LossSpec:
    fn: LossFn
    inputs: tuple[str, ...]  # required loss_fn_inputs besides target_tokens
    config: dict[str, float]  # accepted loss_fn_config keys and their defaults
    optional: tuple[str, ...] = ()  # loss_fn_inputs the loss reads when given


def _ratio(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inp["logprobs"])


def _clipped_surrogate(r: torch.Tensor, adv: torch.Tensor, cfg: dict[str, float]) -> torch.Tensor:
    clipped = r.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(r * adv, clipped * adv).sum()


def cross_entropy(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(inp["weights"] * lp).sum()


def importance_sampling(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(_ratio(lp, inp) * inp["advantages"]).sum()


def ppo(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return _clipped_surrogate(_ratio(lp, inp), inp["advantages"], cfg)


def cispo(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    clipped = _ratio(lp, inp).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(clipped * lp * inp["advantages"]).sum()


def dro(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(lp * inp["advantages"] - 0.5 * cfg["beta"] * (lp - inp["logprobs"]) ** 2).sum()


def gspo(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    adv = inp["advantages"]
    marked = inp["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inp else adv != 0
    log_s = (lp.detach() - inp["logprobs"])[marked].mean() if bool(marked.any()) else lp.new_zeros(())
    return _clipped_surrogate(torch.exp(log_s + lp - lp.detach()), adv, cfg)


def stable_reinforce(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    weight = _ratio(lp, inp).clamp(max=cfg["clip_high_threshold"]).detach()
    loss = -(weight * lp * inp["advantages"]).sum()
    if cfg["kl_coeff"]:
        d = (lp - inp["logprobs"])[inp["logprobs"] != 0]
        loss = loss + cfg["kl_coeff"] * (torch.expm1(d) - d).sum()
    return loss


_RL = ("logprobs", "advantages")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, _RL, {}),
    "ppo": LossSpec(ppo, _RL, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, _RL, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro, _RL, {"beta": 0.05}),
    "gspo": LossSpec(gspo, _RL, {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
                     optional=("sequence_ratio_mask",)),
    "stable_reinforce": LossSpec(stable_reinforce, _RL, {"clip_high_threshold": 2.0, "kl_coeff": 0.0}),
}
