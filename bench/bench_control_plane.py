"""The control plane's cost: operations/s the gateway sustains, and an SFT step's time, per database.

    python bench/bench_control_plane.py [--clients 8] [--ops 100] [--steps 10] [--sft-model NAME --threads N]

For each database (in-memory SQLite, a SQLite file, a live PostgreSQL 16 started by ``pgserver``), an embedded
stack on the tiny model: ``--clients`` SDK clients, each its own run, pipeline ``--ops`` optim_steps (the
cheapest trainer operation, so the gateway's bookkeeping is as large a share as it can be) and the figure is
operations per second over all of them; then one client times ``--steps`` SFT steps (forward_backward +
optim_step of 8 x 256 tokens on ``--sft-model``, submission to both results). The ledger's overhead is the
difference to memory.
First, in-process: what the ledger's two writes of one operation (record, then result) cost the gateway's event
loop, per database, over ``--ledger-ops`` operations.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from machine import cpu_line

import lathe
from lathe import wire
from lathe.gateway.records import Operation
from lathe.gateway.store import ControlStore, StoreConfig
from lathe.stack import Stack, StackConfig
from lathe.v1 import lathe_pb2 as pb

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))
BASE = "lathe/tiny-llama"
ADAM = lathe.AdamParams(learning_rate=1e-3)


def sft_batch(rows: int = 8, tokens: int = 256) -> list[lathe.Datum]:
    rng = random.Random(0)
    out = []
    for _ in range(rows):
        toks = [rng.randrange(3, 250) for _ in range(tokens + 1)]
        out.append(lathe.Datum(model_input=lathe.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * tokens}))
    return out


def pipelined_ops(gateway: str, i: int, ops: int) -> None:
    with lathe.ServiceClient(base_url=gateway, api_key=f"tml-cp-{i}") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=i)
        tc.optim_step(ADAM).result()  # the adapter exists before the clock runs
        futures = [tc.optim_step(ADAM) for _ in range(ops)]
        for f in futures:
            f.result()


def measure(url: str, clients: int, ops: int, steps: int, sft_model: str, threads: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        models = BASE if sft_model == BASE else f"{BASE},{sft_model}"
        cfg = StackConfig(models=models, store_root=Path(tmp) / "store", cache_root=CACHE, trainer_threads=threads,
                          sampler_threads=1, db_url=url or f"sqlite:///{tmp}/control.db")
        with Stack(cfg) as stack:
            with cf.ThreadPoolExecutor(clients) as pool:
                pipelined_ops(stack.gateway, -1, 2)  # warm the trainer's model
                t = time.perf_counter()
                list(pool.map(lambda i: pipelined_ops(stack.gateway, i, ops), range(clients)))
                ops_s = clients * (ops + 1) / (time.perf_counter() - t)
            with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-cp-sft") as sc:
                tc, batch, times = sc.create_lora_training_client(sft_model, rank=8, seed=1), sft_batch(), []
                for _ in range(steps + 1):
                    t = time.perf_counter()
                    fb, opt = tc.forward_backward(batch, "cross_entropy"), tc.optim_step(ADAM)
                    fb.result()
                    opt.result()
                    times.append(time.perf_counter() - t)
            return ops_s, statistics.median(times[1:])


def ledger_us(url: str, n: int) -> float:
    """Microseconds of ``add_op`` + ``finish_op`` per operation (an SFT step's request: 8 x 256 tokens)."""
    store = ControlStore(StoreConfig(url))
    request = pb.TrainerOp(model_id="m", forward_backward=pb.ForwardBackwardRequest(
        data=[wire.datum_to_proto(d) for d in sft_batch()])).SerializeToString()
    result = pb.FutureResult(optim_step=pb.OptimStepOutput(metrics={"loss": 1.0}))
    t = time.perf_counter()
    for i in range(n):
        rid = f"req-{i}"
        store.add_op(Operation(rid, "t", "m", i + 1, "forward_backward", request))
        store.finish_op(rid, result, time.time(), release_key=False)
    took = time.perf_counter() - t
    store.close()
    return took / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ledger-ops", type=int, default=500)
    ap.add_argument("--sft-model", default=BASE,
                    help="base model of the SFT step (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="trainer threads")
    args = ap.parse_args()
    print(cpu_line())
    import pgserver

    with tempfile.TemporaryDirectory(prefix="lathe-pg-") as pg_root:
        pg = pgserver.get_server(pg_root, cleanup_mode="stop")
        try:
            dbs = {"memory (sqlite://)": "sqlite://", "SQLite file": f"sqlite:///{pg_root}/bench.db",
                   "PostgreSQL 16": pg.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)}
            print(f"ledger writes per operation (record + result, in-process, {args.ledger_ops} operations):")
            for name, url in dbs.items():
                print(f"  {name:<20} {ledger_us(url, args.ledger_ops):8.0f} us")
            dbs["SQLite file"] = ""  # the stack's own file
            rows = {name: measure(url, args.clients, args.ops, args.steps, args.sft_model, args.threads)
                    for name, url in dbs.items()}
        finally:
            pg.cleanup()
    ref_ops, ref_step = rows["memory (sqlite://)"]
    print(f"{args.clients} clients x {args.ops} pipelined optim_steps; SFT step 8 x 256 tokens, median of "
          f"{args.steps} on {args.sft_model}; {args.threads} trainer thread(s)")
    print(f"{'database':<20} {'ops/s':>8} {'vs memory':>10} {'SFT step s':>11} {'overhead':>9}")
    for name, (ops_s, step_s) in rows.items():
        print(f"{name:<20} {ops_s:>8.1f} {ops_s / ref_ops - 1:>+10.1%} {step_s:>11.4f} {step_s / ref_step - 1:>+9.1%}")


if __name__ == "__main__":
    main()
