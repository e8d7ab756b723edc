"""``python -m lathe.trainer``: one trainer process for the configured base models: a pool of one, or one rank
of a pool of several (``--world-size``; ``lathe.trainer.ranks``), where rank 0 serves gRPC and leads."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

import grpc

from lathe.models.catalog import ModelCatalog
from lathe.models.pool import add_pool_arguments, apply_threads, config_or_usage_error
from lathe.runtime.probes import Probes, Warmup, add_metrics_port, serve_metrics
from lathe.runtime.serving import run, setup_logging
from lathe.trainer import ranks
from lathe.trainer.custom_loss import LossBudget
from lathe.trainer.dist import PoolFormationError, join
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.recovery import SnapshotPolicy
from lathe.trainer.server import TrainerServicer
from lathe.v1 import lathe_pb2_grpc as pb_grpc

log = logging.getLogger("lathe.trainer")


def main() -> None:
    setup_logging()
    d = TrainerConfig()
    ap = argparse.ArgumentParser(prog="python -m lathe.trainer")
    add_pool_arguments(ap, models=d.models, cache_root=d.cache_root)
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each layer in backward (about half the peak memory, about 20%% slower)")
    ap.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens)
    ap.add_argument("--cycle-tokens", type=int, default=d.cycle_tokens)
    ap.add_argument("--max-resident-adapters", type=int, default=d.max_resident_adapters)
    ap.add_argument("--max-queue", type=int, default=d.max_queue, help="operations waiting, all tenants together")
    ap.add_argument("--max-queue-per-tenant", type=int, default=d.max_queue_per_tenant,
                    help="operations waiting, one tenant's runs together")
    ap.add_argument("--max-runs-per-cycle", type=int, default=d.max_runs_per_cycle,
                    help="0: pack every ready run into a cycle; 1: one run at a time")
    ap.add_argument("--cycle-gather-s", type=float, default=d.cycle_gather_s,
                    help="how long a cycle may wait for the optim_step following a forward_backward")
    ap.add_argument("--rejoin-fraction", type=float, default=d.rejoin_fraction,
                    help="a cycle waits this share of the last one for that one's runs, renewed as each comes back")
    ap.add_argument("--rejoin-max-s", type=float, default=d.rejoin_max_s, help="and never a window longer than this")
    ap.add_argument("--rejoin-write-max-s", type=float, default=d.rejoin_write_max_s,
                    help="but for a run whose answer waits on its snapshot write, up to this long after the cycle")
    ap.add_argument("--page-store", default="", help="directory for paged-out adapters (scratch)")
    ap.add_argument("--order-wait-s", type=float, default=d.order_wait_s,
                    help="operations that wait this long for a seq_id that never arrives fail, naming it")
    ap.add_argument("--snapshot-every", type=int, default=d.snapshots.every_steps,
                    help="write a run's recovery snapshot every this many optimizer steps (0: only at saves)")
    ap.add_argument("--snapshot-stagger", action=argparse.BooleanOptionalAction, default=d.snapshots.stagger,
                    help="offset each run's snapshot steps by its model id, so runs stepping together do not all "
                         "write after the same cycle")
    ap.add_argument("--max-loss-elements", type=int, default=d.loss_budget.elements,
                    help="elements of a custom loss's nodes over one pass's datums, and over one cycle's jobs")
    ap.add_argument("--max-loss-calls", type=int, default=d.loss_budget.calls,
                    help="custom-loss node evaluations over one pass's datums (datums x nodes)")
    add_metrics_port(ap)
    ranks.add_arguments(ap, os.environ)
    args = ap.parse_args()
    try:
        pool, local = ranks.pool_config(args)
    except ValueError as e:
        ap.error(str(e))
    apply_threads(args)
    try:
        loss_budget = LossBudget(args.max_loss_elements, args.max_loss_calls)
    except ValueError as e:
        ap.error(str(e))
    cfg = config_or_usage_error(ap, lambda: config_from(args, loss_budget))
    store = None
    if args.checkpoints:
        from lathe.checkpoints.client import CheckpointsClient

        store = CheckpointsClient(args.checkpoints)
    catalog = ModelCatalog.from_spec(cfg.models, cfg.cache_root)
    if pool is not None and pool.rank > 0:
        follower = ranks.Follower(cfg, catalog, pool).start()
        probes = Probes("lathe.v1.Trainer", "lathe_trainer", follower.ready, follower.alive)
        _serve(args, probes, lambda server: None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(follower.exit_code)  # a follower stopped inside a collective cannot be joined: leave at once
    children = ranks.start_followers(pool, sys.argv[1:]) if local else []
    try:
        group = join(pool, cfg.device, cfg.dtype) if pool is not None else None
    except PoolFormationError as e:
        log.error("%s", e)
        ranks.stop_followers(children, grace_s=0)
        sys.exit(e.exit_code)
    engine = TrainerEngine(cfg, catalog, store, group, on_rank_lost=ranks.exit_soon(children))
    engine.start()
    warm = Warmup(engine.base, catalog.names(), lambda: engine.alive).start()  # ready once every model is loaded
    probes = Probes("lathe.v1.Trainer", "lathe_trainer", warm.ready, warm.alive, registry=engine.metrics.registry)
    _serve(args, probes, lambda server: pb_grpc.add_TrainerServicer_to_server(TrainerServicer(engine), server),
           on_stop=engine.stop)
    ranks.stop_followers(children)


def config_from(args: argparse.Namespace, loss_budget: LossBudget) -> TrainerConfig:
    """The trainer's config from its flags (``ValueError`` naming a value it refuses)."""
    return TrainerConfig(models=args.models, cache_root=args.cache_root, dtype=args.dtype, device=args.device,
                         invariant=not args.no_invariant, sgmv=args.sgmv,
                         activation_checkpointing=args.activation_checkpointing,
                         max_request_tokens=args.max_request_tokens,
                         cycle_tokens=args.cycle_tokens, max_resident_adapters=args.max_resident_adapters,
                         page_store=args.page_store, max_runs_per_cycle=args.max_runs_per_cycle,
                         cycle_gather_s=args.cycle_gather_s, rejoin_fraction=args.rejoin_fraction,
                         rejoin_max_s=args.rejoin_max_s, rejoin_write_max_s=args.rejoin_write_max_s,
                         order_wait_s=args.order_wait_s, max_queue=args.max_queue,
                         max_queue_per_tenant=args.max_queue_per_tenant,
                         snapshots=SnapshotPolicy(every_steps=args.snapshot_every, stagger=args.snapshot_stagger),
                         loss_budget=loss_budget)


def _serve(args: argparse.Namespace, probes: Probes, add: Callable[[grpc.aio.Server], None],
           on_stop: Callable[[], None] | None = None) -> None:
    """Serve gRPC (with health) and, when asked, /metrics, until SIGTERM: the leader's Trainer service, or a
    follower's health alone (every rank answers its pod's probes)."""
    if args.metrics_port >= 0:
        serve_metrics("lathe.trainer", probes.registry, args.host, args.metrics_port)
    run("lathe.trainer", args.host, args.port, add, on_stop=on_stop, probes=probes)


if __name__ == "__main__":
    main()
