"""What recovery snapshots cost a pool of tenants: the same 8-tenant rounds with snapshots and without.

    python bench/bench_snapshots.py [--tenants 8] [--rounds 20] [--every 10] [--rank 16] [--tokens 32]

Two stacks up at once in one process run (SmolLM2, the pool's default dtype): one whose trainer writes each run's
recovery snapshot every ``--every`` optimizer steps (the default policy), one with ``--snapshot-every 0``. Every
tenant has its own rank-``--rank`` adapter and steps (forward_backward of 1 x ``--tokens`` tokens + optim_step) in
lock step with the others through the SDK; after two untimed rounds on each, the stacks take turns, one round at a
time, for ``--rounds`` rounds each (only one stack works at a time; a drifting VM slows both alike). With ``rounds``
a multiple of ``every`` each tenant writes the same number of snapshots whatever its offset. Prints the median round
of each, the snapshot cost per tenant-step ((round with - round without) / tenants), the bytes of one snapshot, the
CPU seconds per round of the trainer and checkpoints processes, and each trainer's thread count at the end: the
writer threads are the only ones snapshots may add (a writer that ran ATen ops would keep an OpenMP team too).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import statistics
import time
from pathlib import Path

from bench_multitenant import CACHE, MODELS, batch
from machine import cpu_line, cpu_seconds

import lathe
from lathe.stack import Stack, StackConfig


class Tenants:
    """``args.tenants`` SDK tenants of one stack stepping in lock step, and the CPU seconds its services spend."""

    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.sc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bench")
        self.clients = [self.sc.create_lora_training_client(MODELS["smollm2"], rank=args.rank, seed=i)
                        for i in range(args.tenants)]
        self.data = [batch(1, args.tokens, i) for i in range(args.tenants)]
        self.pids = {s.name: s.proc.pid for s in stack.services if s.name in ("trainer", "checkpoints")}
        self.rounds: list[float] = []
        self.cpu = dict.fromkeys(self.pids, 0.0)

    def step(self, i: int) -> None:
        fb = self.clients[i].forward_backward(self.data[i], "cross_entropy")
        opt = self.clients[i].optim_step(lathe.AdamParams())
        fb.result()
        opt.result()

    def round(self, timed: bool = True) -> None:
        cpu0, start = {n: cpu_seconds(p) for n, p in self.pids.items()}, time.perf_counter()
        with cf.ThreadPoolExecutor(len(self.clients)) as pool:
            list(pool.map(self.step, range(len(self.clients))))
        if timed:
            self.rounds.append(time.perf_counter() - start)
            for n, p in self.pids.items():
                self.cpu[n] += cpu_seconds(p) - cpu0[n]

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pids['trainer']}/task"))


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
    policies = {"snapshots": args.every, "none": 0}
    with contextlib.ExitStack() as up:
        tenants = {}
        for label, every in policies.items():
            cfg = StackConfig(models=MODELS["smollm2"], store_root=CACHE / f"bench-store-snapshots-{label}",
                              cache_root=CACHE, trainer_threads=2, sampler_threads=1, trainer_dtype="auto",
                              trainer_args=("--snapshot-every", str(every)))
            tenants[label] = Tenants(up.enter_context(Stack(cfg)), args)
        for t in tenants.values():
            t.round(timed=False)
            t.round(timed=False)
        for _ in range(args.rounds):
            for t in tenants.values():
                t.round()
        rows = {label: (statistics.median(t.rounds), {n: c / args.rounds for n, c in t.cpu.items()},
                        snapshot_bytes(CACHE / f"bench-store-snapshots-{label}"), t.threads())
                for label, t in tenants.items()}
        for t in tenants.values():
            t.sc.close()
    print(f"{args.tenants} tenants, 1 x {args.tokens} tokens + optim_step each, rank {args.rank}, "
          f"{args.rounds} rounds each, alternating (median)")
    print(f"{'trainer policy':<28}{'round s':>9}{'trainer cpu s':>15}{'checkpoints cpu s':>19}{'snapshot MB':>13}"
          f"{'trainer threads':>17}")
    for label, (round_s, cpu, size, threads) in rows.items():
        policy = f"--snapshot-every {policies[label]}"
        print(f"{policy:<28}{round_s:>9.3f}{cpu['trainer']:>15.3f}{cpu['checkpoints']:>19.3f}{size / 1e6:>13.1f}"
              f"{threads:>17}")
    extra = rows["snapshots"][0] - rows["none"][0]
    print(f"snapshot cost per tenant-step: {extra / args.tenants * 1e3:.0f} ms "
          f"(round with / without: {rows['snapshots'][0] / rows['none'][0]:.2f})")


if __name__ == "__main__":
    main()
