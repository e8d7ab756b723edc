"""How a run is configured: the optimizers' hyperparameters (``AdamParams``, ``DimuonParams`` and their configs) and
``LoraConfig``, with the checks the training client runs on them before anything is sent."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lathe.errors import InvalidArgument, PermissionDenied


@dataclass(slots=True)
class AdamParams:
    """One AdamW step's hyperparameters (decoupled weight decay; grad_clip_norm 0 = no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> AdamParams:
        """Refuse what AdamW cannot use (``InvalidArgument`` naming the field and value); returns ``self``.

        Every value finite; learning_rate, weight_decay, grad_clip_norm >= 0; betas in [0, 1); eps > 0 (eps 0
        divides zero by zero on a parameter that has no gradient yet)."""
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                raise InvalidArgument(f"adam_params.{name} = {value!r} must be a finite number >= 0")
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise InvalidArgument(f"adam_params.{name} = {getattr(self, name)} must be < 1")
        if self.eps <= 0:
            raise InvalidArgument(f"adam_params.eps = {self.eps} must be > 0")
        return self


@dataclass(frozen=True, slots=True)
class DimuonParams:
    """One Dimuon step's hyperparameters (a run created with ``DimuonOptimizerConfig``; grad_clip_norm <= 0 =
    no clipping). The update itself is ``lathe.trainer.dimuon``'s."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    type: Literal["dimuon"] = "dimuon"

    def check(self) -> DimuonParams:
        """Refuse what Dimuon cannot use (``InvalidArgument`` naming the field and value); returns ``self``:
        every value finite, learning_rate >= 0, beta1 in [0, 1)."""
        for name in ("learning_rate", "grad_clip_norm", "beta1"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidArgument(f"dimuon_params.{name} = {value!r} must be a finite number")
        if self.learning_rate < 0:
            raise InvalidArgument(f"dimuon_params.learning_rate = {self.learning_rate} must be >= 0")
        if not 0 <= self.beta1 < 1:
            raise InvalidArgument(f"dimuon_params.beta1 = {self.beta1} must be in [0, 1)")
        return self


OptimParams = AdamParams | DimuonParams


@dataclass(frozen=True, slots=True)
class AdamOptimizerConfig:
    """The optimizer family of a training run, chosen at creation (Tinker's ``optimizer=``): AdamW, whose
    per-step hyperparameters are ``AdamParams``."""

    type: Literal["adamw"] = "adamw"


@dataclass(frozen=True, slots=True)
class DimuonOptimizerConfig:
    """Dimuon as a training run's optimizer family; its per-step hyperparameters are ``DimuonParams``."""

    type: Literal["dimuon"] = "dimuon"
    version: Literal[1] = 1


OptimizerConfig = AdamOptimizerConfig | DimuonOptimizerConfig
OPTIMIZERS = ("adamw", "dimuon")


def optimizer_family(optimizer: object | None) -> str:
    """The family a creation's ``optimizer=`` names: None is AdamW; a config (Lathe's or tinker's) by its
    ``type``; anything else is refused."""
    kind = "adamw" if optimizer is None else getattr(optimizer, "type", None)
    if kind not in OPTIMIZERS:
        raise InvalidArgument(f"optimizer = {optimizer!r}: Lathe trains with {' or '.join(OPTIMIZERS)} "
                              "(AdamOptimizerConfig, DimuonOptimizerConfig, or None for AdamW)")
    return str(kind)


def optim_params_of(optim_params: object | None, adam_params: AdamParams | None) -> OptimParams:
    """The checked params of an ``optim_step(optim_params, *, adam_params)`` call (Tinker's two spellings)."""
    if optim_params is not None and adam_params is not None:
        raise InvalidArgument("optim_step takes optim_params or the legacy adam_params, not both")
    params = optim_params if optim_params is not None else adam_params
    if not isinstance(params, AdamParams | DimuonParams):
        raise InvalidArgument(f"optim_params = {params!r}: pass AdamParams or DimuonParams")
    return params.check()


def check_no_project(name: str, project: object | None) -> None:
    """Tinker's projects: Lathe has tenants (API keys), not projects, so a project given is refused rather than
    ignored (None, "" and [] name none). The one wording of that refusal, for the SDK and both doors."""
    if project:
        raise InvalidArgument(f"{name} = {project!r}: Lathe has tenants (API keys), not projects; leave {name} "
                              "out to use your own")


def check_weights_access_token(weights_access_token: str | None) -> None:
    """Tinker's token for another account's weights: Lathe's checkpoints stay with their tenant, so none is
    honoured and a given one is refused rather than ignored."""
    if weights_access_token is not None:
        raise PermissionDenied("weights_access_token: Lathe shares no weights across accounts; load your own "
                               "checkpoints without a token")


@dataclass(slots=True)
class LoraConfig:
    """Which modules get LoRA adapters and how they start. ``alpha`` None: the server's default (32)."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float | None = None
