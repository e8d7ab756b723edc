"""Dimuon for one adapter: momentum, damped row/column preconditioning, a matrix sign, a fixed-norm step.

Tinker publishes Dimuon's interface (``DimuonOptimizerConfig``; ``DimuonParams``: learning_rate, beta1,
grad_clip_norm) and describes its pieces: the learning rate is applied to a direction whose Frobenius norm is
sqrt(rank), built from momentum (beta1) preconditioned on rows and columns with damping, and orthogonalised by
matrix-sign iterations. The formulas below are OUR READING of that description:

    g      = grad * min(1, clip / ||grad||)                  (grad_clip_norm > 0; global norm over the adapter)
    m      = b1 * m + (1 - b1) * g                            (momentum, per parameter, fp32)
    for each LoRA matrix M = m: [r, c]  (lora_A: [rank, in], lora_B: [out, rank]; rank = min(r, c))
      row_i  = mean_j M_ij^2          col_j = mean_i M_ij^2
      P      = M / ((row_i + d * mean(row))^(1/4) * (col_j + d * mean(col))^(1/4))     d = DAMPING
      O      = msign(P) = U V^T of P's SVD, by NS_STEPS Newton-Schulz iterations
               X0 = P / ||P||_F ;  X <- 1.5 X - 0.5 X X^T X  (on the smaller Gram side)
      D      = sqrt(rank) * O / ||O||_F                       (||D||_F = sqrt(rank); D = 0 where M = 0)
    p     -= lr * D

The damping is relative (a fraction of the mean row / column energy), so the step does not depend on the
gradient's scale. The iterations converge for every singular value of X0 above about 1e-5 (a cubic step grows a
small one by 1.5x); a direction weaker than that in P is left out. Owns the momentum; the bank owns the
parameters. Metrics as AdamW's: grad_norm:mean, learning_rate:mean, step:max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lathe.trainer.optimizer import grad_norm
from lathe.types import DimuonParams

DAMPING = 1e-3
NS_STEPS = 40


@dataclass(slots=True)
class DimuonState:
    """Momentum per parameter name, and the number of steps taken."""

    momentum: dict[str, torch.Tensor]
    step: int = 0

    @classmethod
    def zeros(cls, params: dict[str, torch.Tensor]) -> DimuonState:
        return cls({n: torch.zeros_like(p) for n, p in params.items()})


def matrix_sign(p: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """msign(P) = U V^T for P = U S V^T, by cubic Newton-Schulz: P [r, c] -> [r, c]; 0 for P = 0."""
    norm = torch.linalg.matrix_norm(p)
    if float(norm) == 0.0:
        return torch.zeros_like(p)
    wide = p.shape[-2] <= p.shape[-1]
    x = (p if wide else p.mT) / norm
    for _ in range(steps):
        x = 1.5 * x - 0.5 * (x @ x.mT) @ x
    return x if wide else x.mT


def direction(m: torch.Tensor) -> torch.Tensor:
    """The step direction D of momentum matrix ``m`` [r, c]: preconditioned, signed, Frobenius norm sqrt(rank)."""
    row = m.square().mean(dim=-1, keepdim=True)
    col = m.square().mean(dim=-2, keepdim=True)
    p = m / ((row + DAMPING * row.mean()).pow(0.25) * (col + DAMPING * col.mean()).pow(0.25))
    o = matrix_sign(torch.nan_to_num(p))  # 0 / 0 where m is all zero
    norm = float(torch.linalg.matrix_norm(o))
    return o if norm == 0.0 else o * (math.sqrt(min(m.shape[-2:])) / norm)


@torch.no_grad()
def dimuon_step(params: dict[str, torch.Tensor], state: DimuonState, hp: DimuonParams) -> dict[str, float]:
    """Apply one update to ``params`` (2-D LoRA matrices) from their ``.grad`` (missing grads count as zero),
    then clear grads."""
    norm = grad_norm(params)
    clip = hp.grad_clip_norm / (norm + 1e-6) if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm else 1.0
    state.step += 1
    for name, p in params.items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        m = state.momentum[name]
        m.lerp_(g * clip, 1 - hp.beta1)
        p.sub_(direction(m), alpha=hp.learning_rate)
        p.grad = None
    return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate, "step:max": float(state.step)}
