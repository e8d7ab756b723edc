"""What recovery snapshots cost a pool of tenants: the same 8-tenant rounds with snapshots and without.

    python bench/bench_snapshots.py [--tenants 8] [--rounds 20] [--every 10] [--rank 16] [--tokens 32]

Two stacks in one process run (SmolLM2, the pool's default dtype): one whose trainer writes each run's recovery
snapshot every ``--every`` optimizer steps (the default policy), one with ``--snapshot-every 0``. Every tenant
has its own rank-``--rank`` adapter and steps (forward_backward of 1 x ``--tokens`` tokens + optim_step) in lock
step with the others through the SDK, for ``--rounds`` rounds after two untimed ones; with ``rounds`` a
multiple of ``every`` each tenant writes the same number of snapshots whatever its offset. Prints the round
time of each, the snapshot cost per tenant-step ((round with - round without) / tenants), the bytes of one
snapshot, and the CPU seconds per round of the trainer and checkpoints processes. Only one stack works at a
time.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time
from pathlib import Path

from bench_multitenant import CACHE, MODELS, batch
from machine import cpu_line, cpu_seconds

import lathe
from lathe.stack import Stack, StackConfig


def measure(stack: Stack, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    """Seconds per lock-step round of ``args.tenants`` tenants, and CPU seconds per round of each service."""
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bench") as sc:
        clients = [sc.create_lora_training_client(MODELS["smollm2"], rank=args.rank, seed=i)
                   for i in range(args.tenants)]
        data = [batch(1, args.tokens, i) for i in range(args.tenants)]

        def step(i: int) -> None:
            fb, opt = clients[i].forward_backward(data[i], "cross_entropy"), clients[i].optim_step(lathe.AdamParams())
            fb.result()
            opt.result()

        pids = {s.name: s.proc.pid for s in stack.services if s.name in ("trainer", "checkpoints")}
        with cf.ThreadPoolExecutor(args.tenants) as pool:
            for k in range(args.rounds + 2):
                if k == 2:
                    start, cpu0 = time.perf_counter(), {n: cpu_seconds(p) for n, p in pids.items()}
                list(pool.map(step, range(args.tenants)))
        seconds = time.perf_counter() - start
        cpu = {n: (cpu_seconds(p) - cpu0[n]) / args.rounds for n, p in pids.items()}
    return seconds / args.rounds, cpu


def snapshot_bytes(store: Path) -> int:
    """Bytes of the largest recovery snapshot generation under ``store``."""
    sizes = [sum(f.stat().st_size for f in d.iterdir()) for d in store.glob("blobs/*/*/recovery/latest/*")]
    return max(sizes, default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    print(cpu_line())
    rows = {}
    for label, every in (("snapshots", args.every), ("none", 0)):
        store = CACHE / f"bench-store-snapshots-{label}"
        cfg = StackConfig(models=MODELS["smollm2"], store_root=store, cache_root=CACHE, trainer_threads=2,
                          sampler_threads=1, trainer_dtype="auto", trainer_args=("--snapshot-every", str(every)))
        with Stack(cfg) as stack:
            rows[label] = (*measure(stack, args), snapshot_bytes(store))
    print(f"{args.tenants} tenants, 1 x {args.tokens} tokens + optim_step each, rank {args.rank}, "
          f"{args.rounds} rounds")
    print(f"{'trainer policy':<28}{'round s':>9}{'trainer cpu s':>15}{'checkpoints cpu s':>19}{'snapshot MB':>13}")
    for label, (round_s, cpu, size) in rows.items():
        policy = f"--snapshot-every {args.every if label == 'snapshots' else 0}"
        print(f"{policy:<28}{round_s:>9.3f}{cpu['trainer']:>15.3f}{cpu['checkpoints']:>19.3f}{size / 1e6:>13.1f}")
    extra = rows["snapshots"][0] - rows["none"][0]
    print(f"snapshot cost per tenant-step: {extra / args.tenants * 1e3:.0f} ms "
          f"(round with / without: {rows['snapshots'][0] / rows['none'][0]:.2f})")


if __name__ == "__main__":
    main()
