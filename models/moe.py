"""Routing of a mixture-of-experts layer, batch-invariant: which experts each token runs and how their outputs sum.

Owns the three steps around the experts' products (the decoder runs the products themselves, with their LoRA):

1. ``route``: top-k of the router's softmax, ties to the lower expert index, optionally renormalized to sum to one
   (Hugging Face's ``norm_topk_prob``), then each token's choices put in ascending expert order;
2. grouping (``route`` too, into ``Routing.groups`` and ``inverse``): the tokens of each expert, ascending (so each
   adapter's rows stay one segment), and the permutation that brings the experts' outputs back to token order;
3. ``combine``: ``out[t] = sum_j y[t, j] * w[t, j]`` over a token's experts in ascending index order, one add at
   a time (the order of Hugging Face's per-expert ``index_add_`` loop).

Every step is per row: a softmax and a stable sort of one row, gathers, and elementwise products and sums in a
fixed order. With the router's logits and the experts' products on the pool's fixed tiles (``ops.linear``), a
token's experts, weights and output have the same bits whatever else is in its batch, so the trainer and the
sampler route every token alike and no router replay is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Routing:
    """Where the tokens of one layer go. ``weights [T, k]`` (the activations' dtype) and ``experts [T, k]``: each
    token's experts in ascending order with their weights; ``groups``: ``(expert, rows)`` for every expert with
    tokens, ascending; ``inverse [T * k]``: the row of ``cat(outputs of groups)`` that holds token ``t``'s slot
    ``j``, at ``t * k + j``."""

    weights: torch.Tensor
    experts: torch.Tensor
    groups: list[tuple[int, list[int]]]
    inverse: torch.Tensor

    def load(self, num_experts: int) -> list[int]:
        """Tokens per expert."""
        counts = [0] * num_experts
        for e, rows in self.groups:
            counts[e] = len(rows)
        return counts


def route(logits: torch.Tensor, k: int, *, normalize: bool, dtype: torch.dtype) -> Routing:
    """The routing of router logits ``[T, E]``: softmax in fp32 (fp64 for fp64 logits), the ``k`` largest
    probabilities with ties to the lower index (a stable descending sort), renormalized when ``normalize`` (summed
    in descending order), cast to ``dtype``. Differentiable in ``logits`` through the weights."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, experts = top.values[:, :k], top.indices[:, :k]
    if normalize:
        total = values[:, 0]
        for j in range(1, k):
            total = total + values[:, j]
        values = values / total[:, None]
    experts, slot = torch.sort(experts, dim=-1)  # a token's experts in ascending order, their weights with them
    weights = values.gather(1, slot).to(dtype)
    flat = experts.reshape(-1).cpu()
    order = torch.argsort(flat, stable=True)  # by expert, then by token: every expert's rows ascending
    rows = torch.div(order, k, rounding_mode="floor").tolist()
    groups, start = [], 0
    for e, n in enumerate(torch.bincount(flat, minlength=logits.shape[1]).tolist()):
        if n:
            groups.append((e, rows[start:start + n]))
            start += n
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return Routing(weights, experts, groups, inverse.to(logits.device))


def combine(outputs: list[torch.Tensor], routing: Routing) -> torch.Tensor:
    """``[T, H]``: each token's expert outputs (``outputs``: one ``[rows, H]`` per group of ``routing``, in its
    order) times their weights, summed over the token's experts in ascending order, one add at a time."""
    weights = routing.weights
    t, k = weights.shape
    ys = torch.cat(outputs)[routing.inverse].view(t, k, -1)
    out = ys[:, 0] * weights[:, :1]
    for j in range(1, k):
        out = out + ys[:, j] * weights[:, j:j + 1]
    return out
