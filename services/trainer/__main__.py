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
from lathe.models.pool import add_pool_arguments, apply_threads
from lathe.runtime.options import add_options, options
from lathe.runtime.probes import Probes, Warmup, add_metrics_port, serve_metrics
from lathe.runtime.serving import run, setup_logging
from lathe.trainer import ranks
from lathe.trainer.dist import PoolFormationError, join
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.trainer.server import TrainerServicer
from lathe.v1 import lathe_pb2_grpc as pb_grpc

log = logging.getLogger("lathe.trainer")


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m lathe.trainer")
    add_pool_arguments(ap)
    add_options(ap, TrainerConfig)
    add_metrics_port(ap)
    ranks.add_arguments(ap, os.environ)
    args = ap.parse_args()
    try:
        pool, local = ranks.pool_config(args)
    except ValueError as e:
        ap.error(str(e))
    apply_threads(args)
    cfg = options(args, TrainerConfig, ap)
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


def _serve(args: argparse.Namespace, probes: Probes, add: Callable[[grpc.aio.Server], None],
           on_stop: Callable[[], None] | None = None) -> None:
    """Serve gRPC (with health) and, when asked, /metrics, until SIGTERM: the leader's Trainer service, or a
    follower's health alone (every rank answers its pod's probes)."""
    if args.metrics_port >= 0:
        serve_metrics("lathe.trainer", probes.registry, args.host, args.metrics_port)
    run("lathe.trainer", args.host, args.port, add, on_stop=on_stop, probes=probes)


if __name__ == "__main__":
    main()
