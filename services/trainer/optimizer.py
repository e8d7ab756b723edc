"""AdamW for one adapter, with Tinker's defaults and per-call hyperparameters.

    g      = grad * min(1, clip / ||grad||)          (only when grad_clip_norm > 0; norm over the adapter)
    p     *= 1 - lr * weight_decay                    (decoupled decay)
    m      = b1 * m + (1 - b1) * g
    v      = b2 * v + (1 - b2) * g^2
    p     -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The arithmetic of ``torch.optim.AdamW`` (its fused kernel). Defaults: lr 1e-4, betas 0.9/0.95,
eps 1e-12, weight_decay 0, grad_clip_norm 0 (off), as ``lathe.types.AdamParams`` states them. Owns the
moments; the bank owns the parameters.
"""

from __future__ import annotations

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

    One fused kernel over the adapter's tensors (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)``
    runs): each element read and written once, about 6x faster than a ``torch._foreach_*`` op per line for a
    rank-16 SmolLM2 adapter (5.6 vs 32.7 ms). Deterministic, so a replay gives the same bits.
    """
    norm = grad_norm(params)
    clip = hp.grad_clip_norm / (norm + 1e-6) if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm else 1.0
    state.step += 1
    ps = list(params.values())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
    if clip != 1.0:
        grads = torch._foreach_mul(grads, clip)
    step = torch.tensor(float(state.step), device=ps[0].device) if ps else None
    if ps:
        torch._fused_adamw_(ps, grads, [state.exp_avg[n] for n in params], [state.exp_avg_sq[n] for n in params], [],
                            [step] * len(ps), amsgrad=False, lr=hp.learning_rate, beta1=hp.beta1, beta2=hp.beta2,
                            weight_decay=hp.weight_decay, eps=hp.eps, maximize=False)
    for p in ps:
        p.grad = None
    return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate, "step:max": float(state.step)}
