"""``python -m lathe.trainer``: one trainer process (a pool of one) for the configured base models."""

from __future__ import annotations

import argparse

from prometheus_client import start_http_server

from lathe.models.catalog import ModelCatalog
from lathe.models.pool import add_pool_arguments, apply_threads
from lathe.serving import run
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.recovery import SnapshotPolicy
from lathe.trainer.server import TrainerServicer
from lathe.v1 import lathe_pb2_grpc as pb_grpc


def main() -> None:
    d = TrainerConfig()
    ap = argparse.ArgumentParser(prog="python -m lathe.trainer")
    add_pool_arguments(ap, models=d.models, cache_root=d.cache_root, dtype=d.dtype)
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each layer in backward (about half the peak memory, about 20%% slower)")
    ap.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens)
    ap.add_argument("--cycle-tokens", type=int, default=d.cycle_tokens)
    ap.add_argument("--max-resident-adapters", type=int, default=d.max_resident_adapters)
    ap.add_argument("--max-runs-per-cycle", type=int, default=d.max_runs_per_cycle,
                    help="0: pack every ready run into a cycle; 1: one run at a time")
    ap.add_argument("--page-store", default="", help="directory for paged-out adapters (scratch)")
    ap.add_argument("--order-wait-s", type=float, default=d.order_wait_s,
                    help="operations that wait this long for a seq_id that never arrives fail, naming it")
    ap.add_argument("--snapshot-every", type=int, default=d.snapshots.every_steps,
                    help="write a run's recovery snapshot every this many optimizer steps (0: only at saves)")
    ap.add_argument("--metrics-port", type=int, default=-1, help="serve Prometheus /metrics here (-1: off)")
    args = ap.parse_args()
    apply_threads(args)
    cfg = TrainerConfig(models=args.models, cache_root=args.cache_root, dtype=args.dtype, device=args.device,
                        invariant=not args.no_invariant, sgmv=args.sgmv,
                        activation_checkpointing=args.activation_checkpointing,
                        max_request_tokens=args.max_request_tokens,
                        cycle_tokens=args.cycle_tokens, max_resident_adapters=args.max_resident_adapters,
                        page_store=args.page_store, max_runs_per_cycle=args.max_runs_per_cycle,
                        order_wait_s=args.order_wait_s,
                        snapshots=SnapshotPolicy(every_steps=args.snapshot_every))
    store = None
    if args.checkpoints:
        from lathe.checkpoints.client import CheckpointsClient

        store = CheckpointsClient(args.checkpoints)
    engine = TrainerEngine(cfg, ModelCatalog.from_spec(cfg.models, cfg.cache_root), store)
    if args.metrics_port >= 0:
        server, _ = start_http_server(args.metrics_port, addr=args.host, registry=engine.metrics.registry)
        print(f"lathe.trainer metrics on http://{args.host}:{server.server_port}/metrics", flush=True)
    engine.start()
    run("lathe.trainer", args.host, args.port,
        lambda server: pb_grpc.add_TrainerServicer_to_server(TrainerServicer(engine), server),
        on_stop=engine.stop)


if __name__ == "__main__":
    main()
