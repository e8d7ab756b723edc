"""AdamW for one adapter, with Tinker's defaults and per-call hyperparameters.

    g      = grad * min(1, clip / ||grad||)          (only when grad_clip_norm > 0; norm over the adapter)
    p     *= 1 - lr * weight_decay                    (decoupled decay)
    m      = b1 * m + (1 - b1) * g
    v      = b2 * v + (1 - b2) * g^2
    p     -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The same arithmetic, in the same order, as ``torch.optim.AdamW``. Defaults: lr 1e-4, betas 0.9/0.95,
eps 1e-12, weight_decay 0, grad_clip_norm 0 (off), as ``lathe.types.AdamParams`` states them. Owns the
moments; the bank owns the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lathe.types import AdamParams  # the SDK's dataclass: one definition of the hyperparameters


@dataclass(slots=True)
class AdamState:
    """First and second moments per parameter name, and the number of steps taken."""

    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int = 0

    @classmethod
    def zeros(cls, params: dict[str, torch.Tensor]) -> AdamState:
        return cls({n: torch.zeros_like(p) for n, p in params.items()},
                   {n: torch.zeros_like(p) for n, p in params.items()})


def grad_norm(params: dict[str, torch.Tensor]) -> float:
    grads = [p.grad for p in params.values() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))


@torch.no_grad()
def adamw_step(params: dict[str, torch.Tensor], state: AdamState, hp: AdamParams) -> dict[str, float]:
    """Apply one update to ``params`` from their ``.grad`` (missing grads count as zero), then clear grads.

    Each line is one ``torch._foreach_*`` call over the adapter's tensors: the same kernel per tensor as the
    per-tensor loop (so the same bits), without a Python round trip per tensor and op.
    """
    norm = grad_norm(params)
    clip = hp.grad_clip_norm / (norm + 1e-6) if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm else 1.0
    state.step += 1
    bc1 = 1 - hp.beta1**state.step
    bc2_sqrt = math.sqrt(1 - hp.beta2**state.step)
    ps = list(params.values())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
    ms, vs = [state.exp_avg[n] for n in params], [state.exp_avg_sq[n] for n in params]
    if clip != 1.0:
        grads = torch._foreach_mul(grads, clip)
    if hp.weight_decay != 0:  # a product by 1.0 changes no bit: skipped
        torch._foreach_mul_(ps, 1 - hp.learning_rate * hp.weight_decay)
    torch._foreach_lerp_(ms, grads, 1 - hp.beta1)
    torch._foreach_mul_(vs, hp.beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - hp.beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_addcdiv_(ps, ms, denom, value=-hp.learning_rate / bc1)
    for p in ps:
        p.grad = None
    return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate, "step:max": float(state.step)}
