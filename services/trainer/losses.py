"""Tinker's loss functions, one datum at a time.

Every loss is a plain sum over the datum's target tokens (Tinker's convention: no mean, the client
chooses the weighting). Inputs per datum, all shaped like ``target_tokens [L]``:

    cross_entropy        weights w                      loss = -(w * lp).sum()
    importance_sampling  logprobs q, advantages A       loss = -(exp(lp - q) * A).sum()
    ppo                  q, A; clip (lo, hi)=(0.8, 1.2)  r = exp(lp - q)
                                                        loss = -min(r * A, clip(r, lo, hi) * A).sum()
    cispo                q, A; clip (lo, hi)=(0.0, 4.0)  loss = -(sg(clip(r, lo, hi)) * lp * A).sum()
    dro                  q, A; beta=0.05                loss = -(lp * A - beta/2 * (lp - q)^2).sum()

``lp`` are the trainer's logprobs of the target tokens; ``sg`` is stop-gradient. Thresholds and beta
are overridable through ``loss_fn_config`` (``clip_low_threshold``, ``clip_high_threshold``, ``beta``).
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


def _ratio(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inp["logprobs"])


def cross_entropy(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(inp["weights"] * lp).sum()


def importance_sampling(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(_ratio(lp, inp) * inp["advantages"]).sum()


def ppo(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    r, adv = _ratio(lp, inp), inp["advantages"]
    clipped = r.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(r * adv, clipped * adv).sum()


def cispo(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    clipped = _ratio(lp, inp).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(clipped * lp * inp["advantages"]).sum()


def dro(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    return -(lp * inp["advantages"] - 0.5 * cfg["beta"] * (lp - inp["logprobs"]) ** 2).sum()


_RL = ("logprobs", "advantages")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, _RL, {}),
    "ppo": LossSpec(ppo, _RL, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, _RL, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro, _RL, {"beta": 0.05}),
}
