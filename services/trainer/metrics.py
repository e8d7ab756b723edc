"""Prometheus metrics of the trainer's clock cycle (served on ``/metrics`` by ``python -m lathe.trainer``).

Owned by ``TrainerEngine`` (``engine.metrics``), written by its cycle thread; the process's ``Probes`` serve the
same registry, beside the gRPC request metrics. These feed the cycle-time and capacity dashboards: how long a
cycle takes, how full it is, how many runs and tenants share it, how many adapters are resident or paged out,
how deep the queues are, how long each operation waited for its cycle, and how far the sampler's logprobs that
RL requests carry are from the trainer's own (``sampler_kl``), and on a mixture-of-experts model, the tokens each
expert was routed (``lathe.runtime.experts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lathe.runtime.experts import ExpertTokens
from lathe.trainer.ops import Example

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = tuple(float(2 ** k) for k in range(4, 21, 2))  # 16 .. 1M tokens
_KL_BUCKETS = (1e-9, 1e-6, 1e-4, 1e-3, 1e-2, 0.1, 1.0)


def sampler_kl(examples: Sequence[Example], logprobs: Sequence[torch.Tensor]) -> float | None:
    """The mean KL(sampler || trainer) over the sampled tokens of a request, None when it carries no sampler
    logprobs. A datum's sampled tokens are those whose ``logprobs`` input ``q`` is non-zero (prompt rows carry
    ``q = 0``); with ``lp`` the trainer's logprobs and ``d = lp - q``, each token contributes
    ``exp(d) - 1 - d`` (an unbiased, non-negative estimator; 0 exactly when the bits agree)."""
    terms = []
    for ex, lp in zip(examples, logprobs, strict=True):
        q = ex.inputs.get("logprobs")
        if q is None:
            continue
        mask = q != 0
        d = lp.detach().to(torch.float64).cpu()[mask] - q.to(torch.float64)[mask]
        terms.append(torch.expm1(d) - d)
    if not terms:
        return None
    flat = torch.cat(terms)
    return float(flat.mean()) if flat.numel() else None


@dataclass(slots=True)
class CycleMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    cycle_seconds: Histogram = field(init=False)
    cycles: Counter = field(init=False)
    tokens: Counter = field(init=False)
    tokens_per_cycle: Histogram = field(init=False)
    capacity: Gauge = field(init=False)
    utilization: Gauge = field(init=False)
    adapters_in_cycle: Gauge = field(init=False)
    tenants_in_cycle: Gauge = field(init=False)
    resident_adapters: Gauge = field(init=False)
    paged_adapters: Gauge = field(init=False)
    queue_depth: Gauge = field(init=False)
    wait_seconds: Histogram = field(init=False)
    planning_seconds: Histogram = field(init=False)
    exactness: Gauge = field(init=False)
    kl: Histogram = field(init=False)
    experts: ExpertTokens = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.cycle_seconds = Histogram("lathe_trainer_cycle_seconds", "Wall time of one clock cycle",
                                       buckets=_TIME_BUCKETS, registry=r)
        self.planning_seconds = Histogram("lathe_trainer_cycle_planning_seconds",
                                          "Time spent planning (scheduling) a cycle", buckets=_TIME_BUCKETS,
                                          registry=r)
        self.cycles = Counter("lathe_trainer_cycles", "Clock cycles run", registry=r)
        self.tokens = Counter("lathe_trainer_cycle_tokens", "Tokens computed in cycles", registry=r)
        self.tokens_per_cycle = Histogram("lathe_trainer_tokens_per_cycle", "Tokens computed in one cycle",
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.capacity = Gauge("lathe_trainer_cycle_capacity_tokens", "Token capacity of one cycle", registry=r)
        self.utilization = Gauge("lathe_trainer_cycle_utilization", "Tokens of the last cycle / capacity",
                                 registry=r)
        self.adapters_in_cycle = Gauge("lathe_trainer_adapters_in_cycle", "Adapters in the last cycle", registry=r)
        self.tenants_in_cycle = Gauge("lathe_trainer_tenants_in_cycle", "Distinct tenants in the last cycle",
                                      registry=r)
        self.resident_adapters = Gauge("lathe_trainer_resident_adapters", "Adapters held in memory", registry=r)
        self.paged_adapters = Gauge("lathe_trainer_paged_adapters", "Adapters paged out to the checkpoint store",
                                    registry=r)
        self.queue_depth = Gauge("lathe_trainer_queue_depth", "Operations waiting for a cycle", registry=r)
        self.exactness = Gauge("lathe_trainer_exactness",
                               "1 when the model passed the pool's exactness self-check, else 0", ["model"],
                               registry=r)
        self.wait_seconds = Histogram("lathe_trainer_operation_wait_seconds",
                                      "Time from an operation's arrival to the start of its cycle",
                                      buckets=_TIME_BUCKETS, registry=r)
        self.kl = Histogram("lathe_trainer_sampler_kl",
                            "Mean KL(sampler || trainer) over the sampled tokens of one RL forward_backward",
                            buckets=_KL_BUCKETS, registry=r)
        self.experts = ExpertTokens(r, "trainer")

    def record_cycle(self, *, seconds: float, tokens: int, capacity: int, runs: int, tenants: int,
                     queued: int) -> None:
        """One finished cycle: its wall time, tokens, runs and tenants, and the operations left waiting."""
        self.cycles.inc()
        self.cycle_seconds.observe(seconds)
        self.tokens.inc(tokens)
        self.tokens_per_cycle.observe(tokens)
        self.utilization.set(tokens / capacity)
        self.adapters_in_cycle.set(runs)
        self.tenants_in_cycle.set(tenants)
        self.queue_depth.set(queued)

    def observe_kl(self, kl: float) -> None:
        """Record the sampler-trainer KL of a finished forward_backward that carried sampler logprobs."""
        self.kl.observe(kl)
