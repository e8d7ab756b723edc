"""The sampler pool's Prometheus metrics, in a registry of its own (served by ``--metrics-port``).

Owned by ``SamplerEngine`` (``engine.metrics``): its scheduler thread records each step (``record_step``: the
batch, the tokens it prefilled and sampled, the running budget in use, the queue), and every finished request
(``record_request``: its wait for admission and its time in the pool), and on a mixture-of-experts model the tokens
each expert was routed (``experts``: ``lathe.runtime.experts``). The process's ``Probes`` serve the same
registry, beside the gRPC request metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lathe.runtime.experts import ExpertTokens

_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(slots=True)
class SamplerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    exactness: Gauge = field(init=False)
    steps: Counter = field(init=False)
    step_seconds: Histogram = field(init=False)
    sampled_tokens: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    batch: Histogram = field(init=False)
    running: Gauge = field(init=False)
    kv_reserved: Gauge = field(init=False)
    kv_capacity: Gauge = field(init=False)
    kv_utilization: Gauge = field(init=False)
    queue_depth: Gauge = field(init=False)
    wait_seconds: Histogram = field(init=False)
    request_seconds: Histogram = field(init=False)
    requests: Counter = field(init=False)
    adapter_events: Counter = field(init=False)
    experts: ExpertTokens = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.exactness = Gauge("lathe_sampler_exactness",
                               "1 when the model passed the pool's exactness self-check, else 0", ["model"],
                               registry=r)
        self.steps = Counter("lathe_sampler_steps", "Batched decoding steps run", registry=r)
        self.step_seconds = Histogram("lathe_sampler_step_seconds", "Wall time of one step", buckets=_TIME_BUCKETS,
                                      registry=r)
        self.sampled_tokens = Counter("lathe_sampler_sampled_tokens", "Tokens sampled (one per sequence per step)",
                                      registry=r)
        self.prompt_tokens = Counter("lathe_sampler_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.batch = Histogram("lathe_sampler_batch_sequences", "Sequences that received a token in one step",
                               buckets=_BATCH_BUCKETS, registry=r)
        self.running = Gauge("lathe_sampler_running_sequences", "Sequences decoding after the last step",
                             registry=r)
        self.kv_reserved = Gauge("lathe_sampler_kv_reserved_tokens",
                                 "KV tokens reserved by running requests (num_samples x (prompt + max_tokens))",
                                 registry=r)
        self.kv_capacity = Gauge("lathe_sampler_kv_capacity_tokens", "The pool's running budget of KV tokens",
                                 registry=r)
        self.kv_utilization = Gauge("lathe_sampler_kv_utilization", "KV tokens reserved / the running budget",
                                    registry=r)
        self.queue_depth = Gauge("lathe_sampler_queue_depth", "Requests accepted and not yet running", registry=r)
        self.wait_seconds = Histogram("lathe_sampler_queue_wait_seconds",
                                      "Time from a request's arrival to its admission into the batch",
                                      buckets=_TIME_BUCKETS, registry=r)
        self.request_seconds = Histogram("lathe_sampler_request_seconds",
                                         "Time from a request's arrival to its answer", buckets=_TIME_BUCKETS,
                                         registry=r)
        self.requests = Counter("lathe_sampler_requests", "Requests answered, by outcome (ok or error)",
                                ["outcome"], registry=r)
        self.adapter_events = Counter("lathe_sampler_engine_adapters",
                                      "Adapters an external engine (sglang) was told to load or unload, by event",
                                      ["event"], registry=r)
        self.experts = ExpertTokens(r, "sampler")

    def record_step(self, *, seconds: float, sequences: int, prompt_tokens: int, running: int, reserved: int,
                    budget: int, queued: int) -> None:
        """One step: its wall time, the sequences that got a token, the prompt tokens it prefilled, and the
        state it left (running sequences, reserved KV tokens of ``budget``, requests queued)."""
        self.steps.inc()
        self.step_seconds.observe(seconds)
        self.sampled_tokens.inc(sequences)
        self.prompt_tokens.inc(prompt_tokens)
        self.batch.observe(sequences)
        self.running.set(running)
        self.kv_reserved.set(reserved)
        self.kv_capacity.set(budget)
        self.kv_utilization.set(reserved / budget)
        self.queue_depth.set(queued)

    def record_request(self, *, queued_s: float, total_s: float, failed: bool) -> None:
        """One answered request: how long it waited for admission and how long it took in all."""
        self.wait_seconds.observe(queued_s)
        self.request_seconds.observe(total_s)
        self.requests.labels(outcome="error" if failed else "ok").inc()
