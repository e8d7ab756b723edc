"""Where a multiplexed round's CPU goes: 8 SDK tenants in lock step against one tenant sending their whole batch.

    python bench/bench_cycle_cpu.py [--model smollm2|tiny] [--tenants 8] [--length 32] [--rounds 10]
                                    [--snapshot-every 0]

One stack (recovery snapshots off unless ``--snapshot-every`` asks for them, so only the training path is measured;
with ``--snapshot-every 1`` every step writes one, and the CPU columns say which process pays for it), two cases in
turn in one process run:
- packed:  ``--tenants`` SDK clients, each forward_backward on 1 x ``--length`` tokens + optim_step, concurrently;
- one big: one client sending ``--tenants`` x ``--length`` tokens + optim_step (the same tokens, one adapter).
For each: the round's wall time and the CPU seconds per round of every process (trainer, gateway, checkpoints,
sampler, and "sdk": this one, the SDK clients), read from /proc, and the ratio packed / one-big. What packed costs
more than one big is the per-tenant work a cycle does not share; the split by process says which service pays it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import time

from bench_multitenant import CACHE, MODELS, RANK, batch
from machine import cpu_line, cpu_seconds

import lathe
from lathe.stack import Stack, StackConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--snapshot-every", type=int, default=0, help="the trainer's --snapshot-every (0: off)")
    args = ap.parse_args()
    model = MODELS[args.model]
    cfg = StackConfig(models=model, store_root=CACHE / "bench-store-cycle-cpu", cache_root=CACHE,
                      trainer_threads=args.threads, sampler_threads=1, trainer_dtype="auto",
                      trainer_args=("--snapshot-every", str(args.snapshot_every)))
    print(f"{model}: {args.tenants} tenants x 1 x {args.length} tokens vs one tenant {args.tenants} x {args.length}, "
          f"rank {RANK}, median of {args.rounds} rounds, recovery snapshots "
          f"{f'every {args.snapshot_every} steps' if args.snapshot_every else 'off'}; {cpu_line()}")
    with Stack(cfg) as stack:
        sc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bench")
        clients = [sc.create_lora_training_client(model, rank=RANK, seed=i) for i in range(args.tenants + 1)]
        cases = {"packed": [(clients[i], batch(1, args.length, i)) for i in range(args.tenants)],
                 "one big": [(clients[-1], batch(args.tenants, args.length, 0))]}
        pids = {s.name: s.proc.pid for s in stack.services} | {"sdk": os.getpid()}

        def step(client: lathe.TrainingClient, data: list[lathe.Datum]) -> None:
            fb = client.forward_backward(data, "cross_entropy")
            opt = client.optim_step(lathe.AdamParams())
            fb.result()
            opt.result()

        def round_of(work: list) -> None:
            with cf.ThreadPoolExecutor(len(work)) as pool:
                list(pool.map(lambda w: step(*w), work))

        rounds: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, dict[str, float]] = {name: dict.fromkeys(pids, 0.0) for name in cases}
        for work in cases.values():
            round_of(work)  # warm: adapters made, first pass paid
        for _ in range(args.rounds):
            for name, work in cases.items():  # alternating, so a drifting machine slows both alike
                before, t0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.perf_counter()
                round_of(work)
                rounds[name].append(time.perf_counter() - t0)
                for k, p in pids.items():
                    cpu[name][k] += (cpu_seconds(p) - before[k]) / args.rounds
        sc.close()
    print(f"{'case':<10}{'round s':>9}" + "".join(f"{k + ' CPU-s':>18}" for k in pids))
    for name in cases:
        print(f"{name:<10}{statistics.median(rounds[name]):>9.3f}" + "".join(f"{cpu[name][k]:>18.3f}" for k in pids))
    packed, big = statistics.median(rounds["packed"]), statistics.median(rounds["one big"])
    extra = cpu["packed"]["trainer"] - cpu["one big"]["trainer"]
    print(f"packed / one big (throughput): {big / packed:.2f}; the trainer's extra CPU a round: {extra:.3f} s "
          f"({1e3 * extra / max(args.tenants - 1, 1):.0f} ms per tenant beyond the first)")


if __name__ == "__main__":
    main()
