"""The ``lathe`` command.

    lathe serve [--port 8500] [--models lathe/tiny-llama,HuggingFaceTB/SmolLM2-135M-Instruct]

starts the embedded stack (checkpoints, trainer, sampler, gateway: each its own process and gRPC server on
loopback), prints where the gateway listens, and stops every child cleanly on Ctrl-C. A child that dies is
started again on its own port (``--restart-budget`` times per ten minutes, each one printed); past the
budget the stack stops and the command exits with status 1.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from lathe.checkpoint_cli import add_commands
from lathe.stack import Stack, StackConfig


def _serve(args: argparse.Namespace) -> None:
    cfg = StackConfig(trainer_ranks=args.trainer_ranks, gateway_port=args.port, http_port=args.http_port,
                      models=args.models, store_root=args.store,
                      cache_root=args.cache, trainer_threads=args.threads, trainer_dtype=args.dtype,
                      invariant=not args.no_invariant, api_keys_file=args.api_keys_file, log_dir=args.log_dir,
                      tls_cert=args.tls_cert, tls_key=args.tls_key, restart_budget=args.restart_budget,
                      quotas_file=args.quotas, db_url=args.db or f"sqlite:///{args.cache.resolve()}/control.db")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Stack(cfg, say=lambda line: print(f"lathe serve: {line}", flush=True)) as stack:
        for s in stack.services:
            print(f"  {s.name:<12} pid {s.proc.pid:<8} {s.address}", flush=True)
        http = f" and {stack.http_url} (Tinker HTTP, official SDK)" if args.http_port >= 0 else ""
        print(f"Lathe gateway listening on {stack.gateway} (gRPC, Lathe SDK){http}  (Ctrl-C to stop)", flush=True)
        while stack.failure is None and not stop.wait(0.5):
            pass
    print("Lathe stopped", flush=True)
    if stack.failure is not None:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="lathe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the embedded stack until Ctrl-C")
    serve.add_argument("--port", type=int, default=8500, help="gateway port on 127.0.0.1 (0: any free port)")
    serve.add_argument("--http-port", type=int, default=8501, help="Tinker HTTP port (0: any free, -1: off)")
    serve.add_argument("--models", default="lathe/tiny-llama,HuggingFaceTB/SmolLM2-135M-Instruct")
    serve.add_argument("--store", default=".cache/lathe/store",
                       help="checkpoints: a directory, s3://bucket[/prefix] (endpoint and keys from LATHE_S3_* "
                            "variables, never argv) or s3-local (a SeaweedFS under --cache)")
    serve.add_argument("--cache", type=Path, default=Path(".cache/lathe"), help="model cache directory")
    serve.add_argument("--threads", type=int, default=0, help="trainer torch threads (0: all cores)")
    serve.add_argument("--trainer-ranks", type=int, default=1,
                       help="processes in the trainer pool (gloo on CPU, NCCL on GPU; docs/distributed.md)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="base weights of both pools (default auto: bfloat16 on a CPU with avx512_bf16 or AMX "
                            "and on a GPU, float32 elsewhere)")
    serve.add_argument("--no-invariant", action="store_true")
    serve.add_argument("--api-keys-file", type=Path, default=None,
                       help="file of KEY=TENANT lines (default: none, open mode: each key is its own tenant)")
    serve.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate for the gateway's doors")
    serve.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    serve.add_argument("--log-dir", type=Path, default=None, help="write each service's stderr here")
    serve.add_argument("--quotas", type=Path, default=None,
                       help="per-tenant quotas: a JSON or .toml file {default: {...}, tenants: {NAME: {...}}}")
    serve.add_argument("--db", default="",
                       help="control-plane database: sqlite:///FILE or postgresql+psycopg://... (default: "
                            "<cache>/control.db, so sessions, runs and results survive a restart of lathe serve)")
    serve.add_argument("--restart-budget", type=int, default=3,
                       help="restarts of a service that dies, per service per 10 minutes (0: stop at the first)")
    serve.set_defaults(fn=_serve)
    add_commands(sub)
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
