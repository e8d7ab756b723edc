"""Prometheus metrics of the trainer's clock cycle (served on ``/metrics`` by ``python -m lathe.trainer``).

These feed the cycle-time and capacity dashboards: how long a cycle takes, how full it is, how many
adapters share it, how many are resident or paged out, how deep the queues are, and how long each
operation waited for its cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(slots=True)
class CycleMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    cycle_seconds: Histogram = field(init=False)
    cycles: Counter = field(init=False)
    tokens: Counter = field(init=False)
    capacity: Gauge = field(init=False)
    utilization: Gauge = field(init=False)
    adapters_in_cycle: Gauge = field(init=False)
    resident_adapters: Gauge = field(init=False)
    paged_adapters: Gauge = field(init=False)
    queue_depth: Gauge = field(init=False)
    wait_seconds: Histogram = field(init=False)
    planning_seconds: Histogram = field(init=False)
    exactness: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.cycle_seconds = Histogram("lathe_trainer_cycle_seconds", "Wall time of one clock cycle",
                                       buckets=_TIME_BUCKETS, registry=r)
        self.planning_seconds = Histogram("lathe_trainer_cycle_planning_seconds",
                                          "Time spent planning (scheduling) a cycle", buckets=_TIME_BUCKETS,
                                          registry=r)
        self.cycles = Counter("lathe_trainer_cycles", "Clock cycles run", registry=r)
        self.tokens = Counter("lathe_trainer_cycle_tokens", "Tokens computed in cycles", registry=r)
        self.capacity = Gauge("lathe_trainer_cycle_capacity_tokens", "Token capacity of one cycle", registry=r)
        self.utilization = Gauge("lathe_trainer_cycle_utilization", "Tokens of the last cycle / capacity",
                                 registry=r)
        self.adapters_in_cycle = Gauge("lathe_trainer_adapters_in_cycle", "Adapters in the last cycle", registry=r)
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
