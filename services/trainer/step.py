"""The math of one cycle: a packed forward (and backward) over the operations of many adapters.

``run_jobs`` takes one ``Job`` per (adapter, forward/forward_backward operation), packs all their
tokens into one flat batch with one LoRA segment per job, runs the base model once, splits the target
logprobs back per datum, computes each job's own loss, and backpropagates the sum of the
forward_backward jobs' losses: each adapter's ``.grad`` receives exactly its own job's gradient
(adapters share no parameters), accumulating onto what earlier cycles left there. Forward-only jobs
run in a separate pass without autograd. A job whose loss is not finite (or whose custom loss fails on
a datum) fails alone; a custom loss's per-datum metrics are summed into its ``JobResult.metric_sums``.

Examples arrive as CPU tensors; the pass runs on the model's device (inputs are moved there) and each
result's logprobs come back on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lathe.errors import InvalidArgument, LatheError
from lathe.models.decoder import Decoder, Packed
from lathe.models.lora import LoraBatch, LoraWeights
from lathe.trainer.custom_loss import CustomLoss
from lathe.trainer.losses import LOSSES
from lathe.trainer.ops import Example


@dataclass(slots=True)
class Job:
    weights: LoraWeights
    examples: list[Example]
    loss_fn: str
    loss_cfg: dict[str, float]
    backward: bool
    custom: CustomLoss | None = None  # loss_fn "custom": runs instead of a built-in loss


@dataclass(slots=True)
class JobResult:
    logprobs: list[torch.Tensor] = field(default_factory=list)  # per datum, [L] fp32
    loss: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)  # a custom loss's metrics, summed over datums
    error: LatheError | None = None

    @property
    def tokens(self) -> int:
        return sum(len(x) for x in self.logprobs)


def run_jobs(model: Decoder, jobs: list[Job]) -> list[JobResult]:
    """Results in the order of ``jobs``."""
    results = [JobResult() for _ in jobs]
    grad_idx = [i for i, j in enumerate(jobs) if j.backward]
    fwd_idx = [i for i, j in enumerate(jobs) if not j.backward]
    if grad_idx:
        _pass(model, [jobs[i] for i in grad_idx], [results[i] for i in grad_idx], backward=True)
    if fwd_idx:
        with torch.no_grad():
            _pass(model, [jobs[i] for i in fwd_idx], [results[i] for i in fwd_idx], backward=False)
    return results


def _pass(model: Decoder, jobs: list[Job], results: list[JobResult], *, backward: bool) -> None:
    examples = [ex for j in jobs for ex in j.examples]
    batch = Packed.from_sequences([ex.tokens for ex in examples])
    seg = [0]
    for j in jobs:
        seg.append(seg[-1] + sum(len(ex) for ex in j.examples))
    lora = LoraBatch(seg, list(range(len(jobs))), [j.weights for j in jobs], invariant=model.invariant,
                     triton=model.sgmv)
    h = model.hidden(batch, lora)
    targets = torch.cat([ex.targets for ex in examples])
    # Cross-entropy's gradient with respect to the logprobs, -weights, is known before they are: the LM head
    # then runs forward and backward chunk by chunk in one pass (no recompute). Other losses need the logprobs
    # first, so their chunks are recomputed in backward.
    fused = backward and all(j.custom is None and j.loss_fn == "cross_entropy" for j in jobs) \
        and len({id(j.weights) for j in jobs}) == len(jobs)
    head_grads: dict[torch.Tensor, torch.Tensor] = {}
    if fused:
        grad_lp = torch.cat([-ex.inputs["weights"] for ex in examples])
        lp, grad_h, head_grads = model.target_logprobs_backward(h, targets, lora, grad_lp)
    else:
        lp = model.target_logprobs(h, targets, lora)
    host = lp.detach().cpu()
    total: torch.Tensor | None = None
    offset = 0
    for job, res in zip(jobs, results, strict=True):
        loss = lp.new_zeros(())
        for ex in job.examples:
            lp_d = lp[offset:offset + len(ex)]
            res.logprobs.append(host[offset:offset + len(ex)])
            offset += len(ex)
            inputs = {k: v.to(lp.device) for k, v in ex.inputs.items()}
            if job.custom is None:
                loss = loss + LOSSES[job.loss_fn].fn(lp_d, inputs, job.loss_cfg)
                continue
            try:
                value, metrics = job.custom(lp_d, inputs)
            except LatheError as e:
                res.error = e
                break
            loss = loss + value
            for key, m in metrics.items():
                res.metric_sums[key] = res.metric_sums.get(key, 0.0) + float(m)
        if res.error is not None:
            continue
        res.loss = float(loss.detach())
        if not math.isfinite(res.loss):
            res.error = InvalidArgument(f"loss {job.loss_fn!r} is {res.loss} for this batch: a non-finite loss "
                                        "is not applied (check the inputs and the adapter's weights)")
            continue
        total = loss if total is None else total + loss
    if fused:
        _backward_fused(h, grad_h, head_grads, jobs, results, seg)
    elif backward and total is not None:
        total.backward()


def _backward_fused(h: torch.Tensor, grad_h: torch.Tensor, head_grads: dict[torch.Tensor, torch.Tensor],
                    jobs: list[Job], results: list[JobResult], seg: list[int]) -> None:
    """The rest of a fused pass's backward: a failed job's rows and head gradients are dropped (it fails
    alone, applying nothing), the head gradients of the others accumulate into ``.grad``, and ``grad_h``
    flows back through the layers."""
    failed = [i for i, res in enumerate(results) if res.error is not None]
    if len(failed) == len(jobs):
        return
    for i in failed:
        grad_h[seg[i]:seg[i + 1]] = 0
        for p in jobs[i].weights.parameters():
            head_grads.pop(p, None)
    with torch.no_grad():
        for p, g in head_grads.items():
            p.grad = g if p.grad is None else p.grad + g
    if h.requires_grad:  # false when the adapters train the LM head alone
        h.backward(grad_h)
