"""The sampler pool's Prometheus metrics, in a registry of its own (served by ``--metrics-port``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge


@dataclass
class SamplerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    exactness: Gauge = field(init=False)

    def __post_init__(self) -> None:
        self.exactness = Gauge("lathe_sampler_exactness",
                               "1 when the model passed the pool's exactness self-check, else 0", ["model"],
                               registry=self.registry)
