"""The load balance of a mixture-of-experts pool: tokens routed to each expert, as Prometheus metrics.

Owned by each pool's metrics (``lathe.trainer.metrics``, ``lathe.sampler.metrics``), fed after each packed pass
with the ``(layer, tokens per expert)`` pairs the decoder's sparse layers routed (``Decoder.hidden``'s ``load``).
Two series per service: ``lathe_<service>_expert_tokens_total{model,layer,expert}`` (a counter: rates give each
expert's share) and ``lathe_<service>_expert_imbalance{model}`` (the busiest expert's tokens over the mean, in the
last pass, the worst layer: 1 is perfect balance, ``num_experts / k`` is every token on the same experts).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge


class ExpertTokens:
    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.tokens = Counter(f"lathe_{service}_expert_tokens", "Tokens routed to an expert of a sparse layer",
                              ["model", "layer", "expert"], registry=registry)
        self.imbalance = Gauge(f"lathe_{service}_expert_imbalance",
                               "Busiest expert's tokens / the mean over experts, last pass, worst sparse layer",
                               ["model"], registry=registry)

    def observe(self, model: str, load: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Count one pass's routing of ``model``: ``(layer, tokens per expert)`` of each sparse layer."""
        worst = 0.0
        for layer, counts in load:
            for expert, n in enumerate(counts):
                if n:
                    self.tokens.labels(model=model, layer=str(layer), expert=str(expert)).inc(n)
            total = sum(counts)
            if total:
                worst = max(worst, max(counts) * len(counts) / total)
        if load:
            self.imbalance.labels(model=model).set(worst)
