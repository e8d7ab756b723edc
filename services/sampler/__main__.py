"""``python -m lathe.sampler``: one native sampler process for the configured base models."""

from __future__ import annotations

import argparse

from lathe.checkpoints.client import CheckpointsClient
from lathe.errors import Unavailable
from lathe.models.catalog import ModelCatalog
from lathe.models.pool import add_pool_arguments, apply_threads, config_or_usage_error
from lathe.runtime.probes import Probes, Warmup, add_metrics_port, serve_metrics
from lathe.runtime.serving import run, setup_logging
from lathe.sampler.engine import SamplerConfig, SamplerEngine
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
    d = SamplerConfig()
    ap = argparse.ArgumentParser(prog="python -m lathe.sampler")
    add_pool_arguments(ap, models=d.models, cache_root=d.cache_root)
    ap.add_argument("--max-running", type=int, default=d.max_running, help="sequences decoding at once")
    ap.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting at most")
    ap.add_argument("--adapter-cache", type=int, default=d.adapter_cache, help="adapters kept loaded")
    ap.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                    help="prompt tokens admitted per step")
    ap.add_argument("--max-running-tokens", type=int, default=d.max_running_tokens,
                    help="running budget: tokens (num_samples x (prompt + max_tokens)) reserved by running requests "
                         "together; one request asking for more is refused")
    ap.add_argument("--kv-blocks", type=int, default=d.kv_blocks,
                    help="KV cache blocks of 64 tokens per base model (0: enough for --max-running-tokens)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="never reuse cached KV blocks of a shared prompt")
    ap.add_argument("--bgmv", choices=["auto", "off", "torch", "triton"], default=d.bgmv,
                    help="decode LoRA through the adapter slot pool (auto: triton with --sgmv --no-invariant on cuda)")
    ap.add_argument("--adapter-slots", type=int, default=d.adapter_slots, help="adapter slots per base model (BGMV)")
    ap.add_argument("--slot-rank", type=int, default=d.slot_rank, help="largest LoRA rank an adapter slot holds")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on cuda")
    add_metrics_port(ap)
    args = ap.parse_args()
    apply_threads(args)
    cfg = config_or_usage_error(ap, lambda: config_from(args))
    source = CheckpointsSource(CheckpointsClient(args.checkpoints)) if args.checkpoints else None
    catalog = ModelCatalog.from_spec(cfg.models, cfg.cache_root)
    engine = SamplerEngine(cfg, catalog, source)
    engine.start()
    warm = Warmup(engine.base, catalog.names(), lambda: engine.alive).start()  # ready once every model is loaded
    probes = Probes("lathe.v1.Sampler", "lathe_sampler", warm.ready, warm.alive, registry=engine.metrics.registry)
    if args.metrics_port >= 0:
        serve_metrics("lathe.sampler", probes.registry, args.host, args.metrics_port)
    run("lathe.sampler", args.host, args.port,
        lambda server: pb_grpc.add_SamplerServicer_to_server(SamplerServicer(engine), server),
        on_stop=engine.stop, probes=probes)


def config_from(args: argparse.Namespace) -> SamplerConfig:
    """The sampler's config from its flags (``ValueError`` naming a value it refuses)."""
    return SamplerConfig(models=args.models, cache_root=args.cache_root, dtype=args.dtype, device=args.device,
                         invariant=not args.no_invariant, sgmv=args.sgmv, max_running=args.max_running,
                         max_queue=args.max_queue, adapter_cache=args.adapter_cache,
                         max_prefill_tokens=args.max_prefill_tokens, max_running_tokens=args.max_running_tokens,
                         kv_blocks=args.kv_blocks, prefix_cache=not args.no_prefix_cache, bgmv=args.bgmv,
                         adapter_slots=args.adapter_slots, slot_rank=args.slot_rank,
                         cuda_graphs=not args.no_cuda_graphs)


if __name__ == "__main__":
    main()
