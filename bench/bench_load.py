"""Load: N concurrent SDK clients, each its own tenant, x M forward_backward + optim_step steps on the tiny model.

    python bench/bench_load.py [--clients 32] [--steps 50] [--threads 1] [--append]

Against an embedded stack (``lathe serve``'s processes). Every client trains its own adapter on its own data; the
same clients are then run again one at a time on a fresh stack (the serial reference). Checks zero errors and that
every client's losses equal its serial run's bit for bit; prints p50/p99 step latency (forward_backward + optim_step,
submission to both results) and the gateway's and trainer's memory high-water marks (VmHWM). ``--append`` adds
the figures, the command and the CPU model to ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from machine import cpu_line

import lathe
from lathe.stack import Stack, StackConfig

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))
BASE = "lathe/tiny-llama"
ADAM = lathe.AdamParams(learning_rate=0.01)


def data(client: int) -> list[lathe.Datum]:
    rng = random.Random(client)
    toks = [rng.randrange(3, 300) for _ in range(33)]
    return [lathe.Datum(model_input=lathe.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 32})]


@dataclass(slots=True)
class ClientRun:
    losses: list[float]
    latencies: list[float]


def client(gateway: str, i: int, steps: int) -> ClientRun:
    with lathe.ServiceClient(base_url=gateway, api_key=f"tml-load-{i}") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=i)
        batch, run = data(i), ClientRun([], [])
        for _ in range(steps):
            t = time.perf_counter()
            fb, opt = tc.forward_backward(batch, "cross_entropy"), tc.optim_step(ADAM)
            run.losses.append(fb.result().metrics["loss:sum"])
            opt.result()
            run.latencies.append(time.perf_counter() - t)
        return run


def high_water_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def stack(threads: int, store: Path) -> Stack:
    return Stack(StackConfig(models=BASE, store_root=store, cache_root=CACHE, trainer_threads=threads,
                             sampler_threads=1))


def run(args: argparse.Namespace) -> dict[str, float | int]:
    with tempfile.TemporaryDirectory(prefix="lathe-load-") as tmp:
        with stack(args.threads, Path(tmp, "concurrent")) as s:
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(args.clients) as pool:
                futures = [pool.submit(client, s.gateway, i, args.steps) for i in range(args.clients)]
                outcomes = [f.exception() or f.result() for f in futures]
            wall = time.perf_counter() - t0
            pids = {svc.name: svc.proc.pid for svc in s.services}
            memory = {name: high_water_mb(pids[name]) for name in ("gateway", "trainer")}
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        with stack(args.threads, Path(tmp, "serial")) as s:
            serial = [client(s.gateway, i, args.steps) for i in range(args.clients)]
    runs = [o for o in outcomes if isinstance(o, ClientRun)]
    mismatched = sum(o.losses != ref.losses for o, ref in zip(outcomes, serial, strict=True)
                     if isinstance(o, ClientRun))
    lat = sorted(x for r in runs for x in r.latencies)
    for e in errors[:3]:
        print(f"error: {e!r}", file=sys.stderr)
    return {"errors": len(errors), "mismatched": mismatched, "steps": len(lat), "wall_s": wall,
            "p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "gateway_hwm_mb": memory["gateway"], "trainer_hwm_mb": memory["trainer"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="trainer torch threads")
    ap.add_argument("--append", action="store_true", help="append the figures to bench/RESULTS.md")
    args = ap.parse_args()
    r = run(args)
    summary = (f"{args.clients} clients x {args.steps} steps: {r['errors']} errors, {r['mismatched']} clients whose "
               f"losses differ from their serial run, {r['steps']} steps in {r['wall_s']:.1f} s; step latency "
               f"p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s; memory high-water: gateway "
               f"{r['gateway_hwm_mb']:.0f} MB, trainer {r['trainer_hwm_mb']:.0f} MB")
    print(summary)
    if args.append:
        command = "OMP_NUM_THREADS=1 .venv/bin/python bench/bench_load.py " + " ".join(sys.argv[1:])
        with (REPO / "bench" / "RESULTS.md").open("a") as f:
            f.write(f"\n## Load: concurrent SDK clients (`bench/bench_load.py`)\n\n`{command}` on {cpu_line()}:"
                    f"\n\n- {summary}.\n")
    if r["errors"] or r["mismatched"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
