"""The sampler's engine interface: what the gRPC door (``server``) and the process (``__main__``) call on an engine,
and the registry that builds the one ``SamplerConfig.engine`` names.

    native  ``engine.SamplerEngine``: Lathe's own continuous-batching engine in this process (CPU or GPU); its
            logprobs equal the trainer's bit for bit when both run the invariant ops
    sglang  ``sglang.SGLangEngine``: drives the pool's SGLang server over HTTP (GPU clusters); its kernels are not
            Lathe's, so it reports itself as not exact

Both take a ``SampleRequest`` and resolve its future to a ``SampleResult`` (output or error), with the same checks
(``validate.check_sample``) and the same protobuf (``intake``), so the gateway cannot tell them apart but by the
exactness they report.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from lathe.sampler.adapters import AdapterSource
from lathe.sampler.config import Catalog, SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.sampler.metrics import SamplerMetrics
from lathe.sampler.sglang import SGLangEngine
from lathe.v1 import lathe_pb2 as pb


class Engine(Protocol):
    """What samples for a sampler pool. ``start`` before the first ``sample``; ``stop`` answers every unfinished
    request with ``Unavailable``."""

    catalog: Catalog
    metrics: SamplerMetrics

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def alive(self) -> bool:
        """False once the engine cannot answer any more (its thread or loop died): the pod should restart."""
        ...

    def warm(self, name: str) -> None:
        """Block until base model ``name`` can be sampled (loaded and self-checked; or its server answers): the
        pool's readiness."""
        ...

    def sample(self, req: pb.SampleRequest) -> Future[pb.SampleResult]:
        """Accept one request; raises ``ResourceExhausted`` (queue full) or ``Unavailable`` (stopping) only."""
        ...

    def capabilities(self) -> pb.ServerCapabilities: ...


ENGINES: dict[str, type] = {"native": SamplerEngine, "sglang": SGLangEngine}


def make_engine(cfg: SamplerConfig, catalog: Catalog, source: AdapterSource | None) -> Engine:
    """The engine ``cfg.engine`` names, over ``catalog``'s models, with checkpoint bytes from ``source``."""
    return ENGINES[cfg.engine](cfg, catalog, source)
