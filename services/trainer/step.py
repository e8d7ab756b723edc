"""The math of one cycle: a packed forward (and backward) over the operations of many adapters.

``run_jobs`` takes one ``Job`` per (adapter, forward/forward_backward operation), packs all their
tokens into one flat batch with one LoRA segment per job, runs the base model once, splits the target
logprobs back per datum, computes each job's own loss, and backpropagates the sum of the
forward_backward jobs' losses: each adapter's ``.grad`` receives exactly its own job's gradient
(adapters share no parameters), accumulating onto what earlier cycles left there. Forward-only jobs
run in a separate pass without autograd. A custom loss's per-datum metrics are summed into its
``JobResult.metric_sums``.

One job never fails another. A job whose loss raises (a custom loss over its budgets or failing at a node,
any exception of a built-in loss) or is not finite fails alone, and the others' losses and gradients are
those of a pass without it. The gradients of a pass are computed first and added into ``.grad`` last, so a
pass that raises anyway (in the backward of a custom loss, out of memory) changes nothing; its jobs are then
run again in halves until the job that raises is alone (``_isolated``).

Examples arrive as CPU tensors; the pass runs on the model's device (inputs are moved there) and each
result's logprobs come back on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lathe.errors import Internal, InvalidArgument, LatheError
from lathe.models.decoder import Decoder, ExpertLoad, Packed
from lathe.models.lora import LoraWeights
from lathe.models.lora_batch import lora_batch
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


def run_jobs(model: Decoder, jobs: list[Job], load: ExpertLoad | None = None) -> list[JobResult]:
    """Results in the order of ``jobs``. Never raises: whatever goes wrong fails the job(s) it belongs to. ``load``,
    where given, receives the routing of each pass's sparse layers (``Decoder.hidden``)."""
    results = [JobResult() for _ in jobs]
    for backward in (True, False):
        idx = [i for i, j in enumerate(jobs) if j.backward == backward]
        if idx:
            for i, res in zip(idx, _isolated(model, [jobs[i] for i in idx], backward, load), strict=True):
                results[i] = res
    return results


def _isolated(model: Decoder, jobs: list[Job], backward: bool, load: ExpertLoad | None) -> list[JobResult]:
    """``_pass`` over ``jobs``; should it raise (an exception no job's own loss caught, e.g. in the backward of a
    custom loss, or out of memory), it has added no gradient, so each half is run again on its own, down to
    the job that fails alone. The others get the results of a pass without it: the same bits, as every op is
    batch-invariant. (The halves run after the failed pass's frames, and the tensors they hold, are let go.)"""
    try:
        with torch.enable_grad() if backward else torch.no_grad():
            return _pass(model, jobs, backward=backward, load=load)
    except Exception as e:  # noqa: BLE001 - narrowed down to the job that raises it
        failure = f"{type(e).__name__}: {e}"
    if len(jobs) == 1:
        return [JobResult(error=Internal(f"{_named(jobs[0])}: the pass failed: {failure}"))]
    half = len(jobs) // 2
    return _isolated(model, jobs[:half], backward, load) + _isolated(model, jobs[half:], backward, load)


def _pass(model: Decoder, jobs: list[Job], *, backward: bool, load: ExpertLoad | None = None) -> list[JobResult]:
    results = [JobResult() for _ in jobs]
    examples = [ex for j in jobs for ex in j.examples]
    batch = Packed.from_sequences([ex.tokens for ex in examples])
    seg = [0]
    for j in jobs:
        seg.append(seg[-1] + sum(len(ex) for ex in j.examples))
    lora = lora_batch(seg, list(range(len(jobs))), [j.weights for j in jobs], invariant=model.invariant,
                      sgmv=model.sgmv)
    routed: ExpertLoad = []
    h = model.hidden(batch, lora, load=routed)
    if load is not None:
        load += routed  # taken before backward, where recomputed layers route again
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
    for job, res, start in zip(jobs, results, seg[:-1], strict=True):
        try:
            loss = _job_loss(job, res, lp, host, start)
        except LatheError as e:
            res.error = e
            continue
        except Exception as e:  # noqa: BLE001 - one job's loss fails that job alone
            res.error = Internal(f"{_named(job)} failed: {type(e).__name__}: {e}")
            continue
        res.loss = float(loss.detach())
        if not math.isfinite(res.loss):
            res.error = InvalidArgument(f"loss {job.loss_fn!r} is {res.loss} for this batch: a non-finite loss "
                                        "is not applied (check the inputs and the adapter's weights)")
            continue
        total = loss if total is None else total + loss
    if fused:
        _backward_fused(h, grad_h, head_grads, jobs, results, seg)
    elif backward and total is not None and total.requires_grad:  # a loss may be constant: no gradient at all
        params = _params([j for j, res in zip(jobs, results, strict=True) if res.error is None])
        _accumulate(zip(params, torch.autograd.grad(total, params, allow_unused=True), strict=True))
    return results


def _job_loss(job: Job, res: JobResult, lp: torch.Tensor, host: torch.Tensor, start: int) -> torch.Tensor:
    """The sum of ``job``'s datum losses (its datums' rows start at ``start``); fills in its logprobs and
    metric sums. A custom loss is sized against its budgets first (``CustomLoss.plan``)."""
    if job.custom is not None:
        job.custom.plan([(len(ex), ex.inputs) for ex in job.examples])
    loss = lp.new_zeros(())
    offset = start
    for ex in job.examples:
        lp_d = lp[offset:offset + len(ex)]
        res.logprobs.append(host[offset:offset + len(ex)])
        offset += len(ex)
        inputs = {k: v.to(lp.device) for k, v in ex.inputs.items()}
        if job.custom is None:
            loss = loss + LOSSES[job.loss_fn].fn(lp_d, inputs, job.loss_cfg)
            continue
        value, metrics = job.custom(lp_d, inputs)
        loss = loss + value
        for key, m in metrics.items():
            res.metric_sums[key] = res.metric_sums.get(key, 0.0) + float(m)
    return loss


def _named(job: Job) -> str:
    return f"custom loss {job.custom.graph.name!r}" if job.custom is not None else f"loss {job.loss_fn!r}"


def _params(jobs: list[Job]) -> list[torch.Tensor]:
    """The trainable parameters of ``jobs``' adapters, each once."""
    return list({id(p): p for j in jobs for p in j.weights.parameters()}.values())


def _accumulate(grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Add each gradient into its parameter's ``.grad`` as autograd's backward does (the same sums, a new
    ``.grad`` laid out like its parameter). Runs only once a pass has computed every gradient, so a pass that
    raises leaves ``.grad`` as it found it."""
    with torch.no_grad():
        for p, g in grads:
            if g is None:
                continue
            if p.grad is None:
                p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)


def _backward_fused(h: torch.Tensor, grad_h: torch.Tensor, head_grads: dict[torch.Tensor, torch.Tensor],
                    jobs: list[Job], results: list[JobResult], seg: list[int]) -> None:
    """The rest of a fused pass's backward: a failed job's rows and head gradients are dropped (it fails
    alone, applying nothing), ``grad_h`` flows back through the layers, and then the head gradients and the
    layers' of the others accumulate into ``.grad``."""
    failed = [i for i, res in enumerate(results) if res.error is not None]
    if len(failed) == len(jobs):
        return
    for i in failed:
        grad_h[seg[i]:seg[i + 1]] = 0
        for p in jobs[i].weights.parameters():
            head_grads.pop(p, None)
    params = _params([j for i, j in enumerate(jobs) if i not in failed])
    # h needs no gradient when the adapters train the LM head alone
    layers = torch.autograd.grad(h, params, grad_h, allow_unused=True) if h.requires_grad else [None] * len(params)
    _accumulate(head_grads.items())
    _accumulate(zip(params, layers, strict=True))
