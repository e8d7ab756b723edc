"""``python -m lathe.sampler``: one sampler process for the configured base models, on the engine ``--engine`` names."""

from __future__ import annotations

import argparse

from lathe.checkpoints.client import CheckpointsClient
from lathe.errors import Unavailable
from lathe.models.catalog import ModelCatalog
from lathe.models.pool import add_pool_arguments, apply_threads
from lathe.runtime.options import add_options, options
from lathe.runtime.probes import Probes, Warmup, add_metrics_port, serve_metrics
from lathe.runtime.serving import run, setup_logging
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engines import make_engine
from lathe.sampler.server import SamplerServicer
from lathe.v1 import lathe_pb2_grpc as pb_grpc


class CheckpointsSource:
    """``AdapterSource`` over the checkpoints service.

    The client's ``get`` returns files without their creation time, so the version is read with
    ``stat`` before and after: equal stamps mean no overwrite landed in between, so the files are the
    version reported (the store replaces a checkpoint atomically and stamps every write anew).
    """

    def __init__(self, client: CheckpointsClient, attempts: int = 3) -> None:
        self.client, self.attempts = client, attempts

    def get(self, tenant: str, path: str) -> tuple[dict[str, bytes], float]:
        for _ in range(self.attempts):
            before = self.client.stat(tenant=tenant, path=path).created_at
            files = self.client.get(tenant=tenant, path=path)
            if self.client.stat(tenant=tenant, path=path).created_at == before:
                return files, before
        raise Unavailable(f"the checkpoint at {path} kept changing while it was read; retry later")


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m lathe.sampler")
    add_pool_arguments(ap)
    add_options(ap, SamplerConfig)
    add_metrics_port(ap)
    args = ap.parse_args()
    apply_threads(args)
    cfg = options(args, SamplerConfig, ap)
    source = CheckpointsSource(CheckpointsClient(args.checkpoints)) if args.checkpoints else None
    catalog = ModelCatalog.from_spec(cfg.models, cfg.cache_root)
    engine = make_engine(cfg, catalog, source)
    engine.start()
    # ready once every model is loaded (native) or the SGLang server answers (sglang)
    warm = Warmup(engine.warm, catalog.names(), lambda: engine.alive).start()
    probes = Probes("lathe.v1.Sampler", "lathe_sampler", warm.ready, warm.alive, registry=engine.metrics.registry)
    if args.metrics_port >= 0:
        serve_metrics("lathe.sampler", probes.registry, args.host, args.metrics_port)
    run("lathe.sampler", args.host, args.port,
        lambda server: pb_grpc.add_SamplerServicer_to_server(SamplerServicer(engine), server),
        on_stop=engine.stop, probes=probes)


if __name__ == "__main__":
    main()
