"""A run's optimizer, by family: which state it keeps, how a step applies, how the state is saved.

    family   state                          per-step params   tensors in optimizer.safetensors
    adamw    AdamState   (optimizer.py)     AdamParams        exp_avg/<name>, exp_avg_sq/<name>
    dimuon   DimuonState (dimuon.py)        DimuonParams      momentum/<name>

The family is fixed when the run is created (``optimizer`` of ``CreateAdapterRequest``) and recorded in the
training state's ``trainer_state.json``; a state loaded with its optimizer brings its own family. The bank owns
the state object; this module only maps between families.
"""

from __future__ import annotations

import torch

from lathe.errors import FailedPrecondition, InvalidArgument
from lathe.trainer.dimuon import DimuonState, dimuon_step
from lathe.trainer.optimizer import AdamState, adamw_step
from lathe.types import OPTIMIZERS, AdamParams, DimuonParams, OptimParams

OptimState = AdamState | DimuonState
_SLOTS = {"adamw": ("exp_avg", "exp_avg_sq"), "dimuon": ("momentum",)}


def check_family(family: str) -> str:
    """``family`` ("" is AdamW) once it is one Lathe trains with."""
    family = family or "adamw"
    if family not in OPTIMIZERS:
        raise InvalidArgument(f"optimizer = {family!r}: Lathe trains with {' or '.join(OPTIMIZERS)}")
    return family


def family_of(state: OptimState) -> str:
    return "dimuon" if isinstance(state, DimuonState) else "adamw"


def new_state(family: str, params: dict[str, torch.Tensor]) -> OptimState:
    return DimuonState.zeros(params) if check_family(family) == "dimuon" else AdamState.zeros(params)


def optim_step(params: dict[str, torch.Tensor], state: OptimState, hp: OptimParams) -> dict[str, float]:
    """One step of the run's optimizer; ``hp`` must be its family's params (``InvalidArgument`` otherwise)."""
    if isinstance(state, DimuonState) and isinstance(hp, DimuonParams):
        return dimuon_step(params, state, hp)
    if isinstance(state, AdamState) and isinstance(hp, AdamParams):
        return adamw_step(params, state, hp)
    given = "DimuonParams" if isinstance(hp, DimuonParams) else "AdamParams"
    raise InvalidArgument(f"optim_step: this run was created with optimizer {family_of(state)!r}; "
                          f"{given} belong to another family")


def state_tensors(state: OptimState) -> dict[str, torch.Tensor]:
    """The state's tensors themselves (on their device) by ``<slot>/<name>``, for ``optimizer.safetensors``
    (``lathe.models.host.safetensors_bytes`` copies each from its device once)."""
    return {f"{slot}/{n}": t
            for slot in _SLOTS[family_of(state)] for n, t in getattr(state, slot).items()}


def state_from_tensors(family: str, tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                       step: int) -> OptimState:
    """The state saved by ``state_tensors`` for ``params`` (on their devices); refuses one that lacks a tensor."""
    slots = _SLOTS[check_family(family)]
    missing = [f"{slot}/{n}" for slot in slots for n in params if f"{slot}/{n}" not in tensors]
    if missing:
        raise FailedPrecondition(f"checkpoint {family} optimizer state lacks {missing[:3]}")
    moments = [{n: tensors[f"{slot}/{n}"].to(p.device) for n, p in params.items()} for slot in slots]
    return DimuonState(*moments, step) if family == "dimuon" else AdamState(*moments, step)
