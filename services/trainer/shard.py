"""A cycle's packed pass split over the ranks of a trainer pool, by adapter.

Every rank holds the same adapters and the same plan (``lathe.trainer.plan``). ``assign`` gives each job (one
adapter's forward / forward_backward part in this cycle) to one rank, a pure function of the jobs' token counts,
so every rank computes the same assignment without talking. ``run_sharded`` then

    1. runs this rank's jobs as one packed pass (``step.run_jobs``),
    2. ``Group.gather``: every job's ``JobResult`` (logprobs, loss, metrics or error), and which of its
       parameters hold a gradient,
       reach every rank (the leader answers operations with them; every rank folds them in alike),
    3. ``Group.all_gather`` of ONE flat fp32 bucket per rank: the accumulated ``.grad`` of every adapter the rank
       owns in this cycle; each rank copies the other owners' gradients into its own adapters.

Exactness: an adapter's gradient is computed whole on its owner, from the same rows as the 1-rank pool's pass,
and the batch-invariant ops (``lathe.kernels.ops``) make a row's bits independent of what else is packed with
it, forward and backward. The exchange moves those bits as they are (a gather, not a sum: there is no reduction
order to fix and no -0.0 + 0.0 to normalise), so every rank ends the cycle with exactly the 1-rank pool's
losses, logprobs and gradients, and the optimizer steps after it agree bit for bit. The granule is the adapter:
one adapter's job is never split over ranks, so a cycle with fewer adapters than ranks leaves ranks idle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lathe.trainer.dist import Group
from lathe.trainer.step import Job, JobResult


def assign(tokens: list[int], world: int) -> list[int]:
    """Owner rank of each job: largest job first (ties: earlier job), each to the least loaded rank so far
    (ties: the lowest rank). Deterministic, so every rank computes the same owners."""
    load = [0] * world
    owners = [0] * len(tokens)
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += tokens[i]
    return owners


# what one rank reports of one of its jobs: (job index, its result, has-grad per parameter)
Report = tuple[int, JobResult, tuple[bool, ...]]


def run_sharded(group: Group, jobs: list[Job], run: Callable[[list[Job]], list[JobResult]]) -> list[JobResult]:
    """Results of ``jobs`` in their order, on every rank, with every backward job's gradients in place on every
    rank. ``run`` computes a list of jobs as one packed pass (and answers a failure with errors, never raises);
    a failed collective raises ``RankLost``."""
    owners = assign([sum(len(x) for x in j.examples) for j in jobs], group.world)
    mine = [i for i, owner in enumerate(owners) if owner == group.rank]
    reports: list[Report] = [(i, r, _has_grad(jobs[i]))
                             for i, r in zip(mine, run([jobs[i] for i in mine]), strict=True)]
    results: list[JobResult | None] = [None] * len(jobs)
    has_grad: list[tuple[bool, ...]] = [()] * len(jobs)
    for rank_reports in group.gather(reports):
        for i, result, flags in rank_reports:
            results[i], has_grad[i] = result, flags
    _exchange_grads(group, jobs, owners, has_grad)
    return [r for r in results if r is not None]


def _has_grad(job: Job) -> tuple[bool, ...]:
    return tuple(p.grad is not None for p in job.weights.named_parameters().values()) if job.backward else ()


def _exchange_grads(group: Group, jobs: list[Job], owners: list[int], has_grad: list[tuple[bool, ...]]) -> None:
    """One ``all_gather`` of per-rank buckets: rank r's bucket is the flattened ``.grad`` of every parameter that
    holds one, of every backward job r owns, in job then parameter order (zero-padded to the longest bucket)."""
    held: list[list[torch.Tensor]] = [[] for _ in range(group.world)]
    for i, job in enumerate(jobs):
        if not job.backward:
            continue
        for p, has in zip(job.weights.named_parameters().values(), has_grad[i], strict=True):
            if has:
                held[owners[i]].append(p)
            elif owners[i] != group.rank:
                p.grad = None
    longest = max(sum(p.numel() for p in params) for params in held)
    if longest == 0:
        return
    own = held[group.rank]
    device = own[0].device if own else next(p for params in held for p in params).device
    bucket = torch.zeros(longest, dtype=torch.float32, device=device)
    if own:
        flat = torch.cat([p.grad.reshape(-1) for p in own])
        bucket[:flat.numel()] = flat
    for rank, got in enumerate(group.all_gather(bucket)):
        if rank == group.rank:
            continue
        offset = 0
        for p in held[rank]:
            p.grad = got[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
