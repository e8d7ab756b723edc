"""Multiplexing: 8 tenants training at once, packed into shared clock cycles vs. one tenant at a time.

    python bench/bench_multitenant.py [--model tiny|smollm2|both] [--tenants 8] [--steps 4]

Through the SDK and the services, as users see it. Every tenant has its own LoRA adapter and submits
forward_backward + optim_step pairs concurrently, for ``--steps`` steps. Three cases on two servers, one
process run, the same operations:
- packed:   Lathe's trainer, every ready tenant shares each cycle (one packed forward/backward);
- serial:   the same trainer with ``--max-runs-per-cycle 1``: one tenant's batch per cycle, adapter
            swapped per batch (how open clones serve tenants);
- one big:  a single tenant submitting the same total batch (what multiplexing should cost: nothing).
Batch shapes per tenant: 1x32, 1x128 and 4x128 tokens. Prints aggregate tokens/s, mean step latency,
the packed/serial speedup, packed vs. one-big, and the cycle planning overhead read from the trainer's
Prometheus metrics. Beside the packed run: the arithmetic floor of a round (its training FLOPs at this
machine's measured GEMM rate), the trainer's own cycle time, cycles and passes (cycles that computed
tokens) per round (its metrics), and three overheads per tenant-step: (round time - floor) / tenants, the time
a tenant's step costs beyond its arithmetic at the GEMM rate; (round time - the trainer's cycle time) / tenants, what
a step costs outside the trainer's cycles (SDK, gateway, queues: the issue's "step time minus its share of cycle
time"); and (packed round - one-big round) / tenants, what a tenant costs a cycle beyond the same tokens of one.

Shared VMs drift (the same round read 1.8 and 2.6 s minutes apart on one 2-core machine), so both servers run
at once (only the one being measured works) and every case is measured ``--repeats`` times, packed, serial and
one-big in turn, and the median is printed. Beside it, the paired ratios: each repeat's packed run over the serial
and one-big runs right after it (the same phase of the VM), their median.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import random
import re
import statistics
import time
import urllib.request
from pathlib import Path

from machine import cpu_line, gemm_gflops

import lathe
from lathe.models.config import ModelConfig
from lathe.models.lora import ATTN_TARGETS, MLP_TARGETS, module_shape
from lathe.models.pool import resolve_dtype
from lathe.stack import Stack, StackConfig

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))
MODELS = {"tiny": "lathe/tiny-llama", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
MODEL_DIRS = {"tiny": "tiny-llama", "smollm2": "SmolLM2-135M-Instruct"}  # under CACHE, made by the first Stack
SHAPES = [(1, 32), (1, 128), (4, 128)]
RANK = 16


def train_flops_per_token(cfg: ModelConfig, rank: int, length: int) -> float:
    """FLOPs of one cross-entropy-trained token: base forward and dX backward (a cross-entropy pass does not
    recompute the LM head); LoRA (rank ``rank`` on every target and the head) forward, dX and dW; causal
    attention at ``length``."""
    lin = cfg.num_layers * sum(i * o for i, o in (module_shape(cfg, t) for t in ATTN_TARGETS + MLP_TARGETS))
    head = cfg.hidden_size * cfg.vocab_size
    lora = cfg.num_layers * sum(rank * (i + o) for i, o in (module_shape(cfg, t) for t in ATTN_TARGETS + MLP_TARGETS))
    lora_head = rank * (cfg.hidden_size + cfg.vocab_size)
    attention = cfg.num_layers * 4 * (length / 2) * cfg.num_heads * cfg.head_dim * 3
    return 2 * 2 * (lin + head) + 2 * 3 * (lora + lora_head) + attention


def batch(n: int, length: int, seed: int) -> list[lathe.Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = [rng.randrange(3, 300) for _ in range(length + 1)]
        out.append(lathe.Datum(model_input=lathe.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * length}))
    return out


def tenant_loop(tc: lathe.TrainingClient, data: list[lathe.Datum], steps: int) -> list[float]:
    lat = []
    for _ in range(steps):
        t = time.perf_counter()
        fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(lathe.AdamParams())
        fb.result()
        opt.result()
        lat.append(time.perf_counter() - t)
    return lat


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def trainer_metrics(stack: Stack) -> str:
    trainer = next(s for s in stack.services if s.name == "trainer")
    url = next(line.split(" on ")[-1] for line in trainer.lines if "metrics on" in line)
    return urllib.request.urlopen(url, timeout=10).read().decode()


class Tenants:
    """``tenants`` training clients of one stack, each with its own adapter and batch of n x length tokens."""

    def __init__(self, sc: lathe.ServiceClient, model: str, tenants: int, n: int, length: int, first_seed: int
                 ) -> None:
        self.clients = [sc.create_lora_training_client(model, rank=RANK, seed=first_seed + i) for i in range(tenants)]
        self.data = [batch(n, length, first_seed + i) for i in range(tenants)]
        self.tokens = tenants * n * length
        self.run(1)  # warm-up: every adapter's first step (its rank check)

    def run(self, steps: int) -> list[list[float]]:
        """Every tenant steps ``steps`` times at once; each one's step latencies."""
        with cf.ThreadPoolExecutor(len(self.clients)) as pool:
            return list(pool.map(lambda i: tenant_loop(self.clients[i], self.data[i], steps), range(len(self.clients))))

    def measure(self, stack: Stack, steps: int) -> dict[str, float]:
        """``steps`` steady rounds: one step first, untimed, so that the tenants arrive together (the trainer's last
        cycle was another case's, whose runs its next cycle would wait for in vain)."""
        self.run(1)
        before = trainer_metrics(stack)
        t0 = time.perf_counter()
        lats = self.run(steps)
        wall = time.perf_counter() - t0
        after = trainer_metrics(stack)

        def grew(name: str) -> float:
            return metric(after, name) - metric(before, name)

        return {"tokens_per_s": self.tokens * steps / wall, "round_s": wall / steps,
                "cycle_s": grew("lathe_trainer_cycle_seconds_sum") / steps,
                "cycles": grew("lathe_trainer_cycle_seconds_count") / steps,
                "passes": (grew("lathe_trainer_tokens_per_cycle_count")
                           - grew('lathe_trainer_tokens_per_cycle_bucket{le="16.0"}')) / steps,
                "latency_s": statistics.mean(x for lat in lats for x in lat)}


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run of median throughput (its other figures with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def measure(stacks: dict[str, Stack], model: str, tenants: int, n: int, length: int, steps: int,
            repeats: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Every case ``repeats`` times, the cases alternating, and the median run of each: ``tenants`` tenants
    stepping at once on each stack (``packed``, ``serial``), and one tenant with their whole batch on the packed
    stack (``big``); and the median over repeats of packed's throughput over each other case's in that repeat."""
    clients = [lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bench") for stack in stacks.values()]
    try:
        by_stack = dict(zip(stacks, clients, strict=True))
        cases = {label: (stacks[label], Tenants(by_stack[label], model, tenants, n, length, 0)) for label in stacks}
        cases["big"] = (stacks["packed"], Tenants(by_stack["packed"], model, 1, n * tenants, length, tenants))
        runs: dict[str, list[dict[str, float]]] = {label: [] for label in cases}
        for _ in range(repeats):
            for label, (stack, case) in cases.items():
                runs[label].append(case.measure(stack, steps))
    finally:
        for c in clients:
            c.close()
    paired = {label: statistics.median(p["tokens_per_s"] / o["tokens_per_s"]
                                       for p, o in zip(runs["packed"], runs[label], strict=True))
              for label in ("serial", "big")}
    return {label: median_run(r) for label, r in runs.items()}, paired


def planning_share(stack: Stack) -> float:
    text = trainer_metrics(stack)
    cycle = metric(text, "lathe_trainer_cycle_seconds_sum")
    plan = metric(text, "lathe_trainer_cycle_planning_seconds_sum")
    return plan / cycle if cycle else 0.0


def run_model(key: str, args: argparse.Namespace) -> None:
    model = MODELS[key]
    print(f"\n{model}: {args.tenants} tenants, LoRA rank {RANK}, median of {args.repeats} runs of {args.steps} steps, "
          f"{args.dtype}, trainer threads {args.threads}, cycle capacity {args.cycle_tokens} tokens, snapshots every "
          f"{args.snapshot_every if args.snapshot_every is not None else 'the trainer default'} steps; {cpu_line()}")
    print(f"{'tokens/tenant':<14}{'packed tok/s':>13}{'serial tok/s':>13}{'one-big tok/s':>14}"
          f"{'packed/serial':>14}{'packed/one-big':>15}{'lat packed s':>13}{'lat serial s':>13}")
    rows = {}
    shapes = [s for s in SHAPES if f"{s[0]}x{s[1]}" in args.shapes.split(",")]
    with contextlib.ExitStack() as up:  # both stacks up at once, measured in turn (an idle stack costs ~nothing)
        stacks = {}
        snapshots = () if args.snapshot_every is None else ("--snapshot-every", str(args.snapshot_every))
        for label, extra in (("packed", snapshots), ("serial", (*snapshots, "--max-runs-per-cycle", "1"))):
            cfg = StackConfig(models=model, store_root=CACHE / f"bench-store-{label}", cache_root=CACHE,
                              trainer_threads=args.threads, sampler_threads=1, trainer_dtype=args.dtype,
                              trainer_args=("--metrics-port", "0", "--cycle-tokens", str(args.cycle_tokens), *extra))
            stacks[label] = up.enter_context(Stack(cfg))
        paired = {}
        for n, length in shapes:
            medians, paired[(n, length)] = measure(stacks, model, args.tenants, n, length, args.steps, args.repeats)
            for label, row in medians.items():
                rows[(label, n, length)] = row
        share = planning_share(stacks["packed"])
    for n, length in shapes:
        p, s, b = rows[("packed", n, length)], rows[("serial", n, length)], rows[("big", n, length)]
        print(f"{f'{n}x{length}':<14}{p['tokens_per_s']:>13.0f}{s['tokens_per_s']:>13.0f}{b['tokens_per_s']:>14.0f}"
              f"{p['tokens_per_s'] / s['tokens_per_s']:>14.2f}{p['tokens_per_s'] / b['tokens_per_s']:>15.2f}"
              f"{p['latency_s']:>13.3f}{s['latency_s']:>13.3f}")
    for n, length in shapes:
        pair = paired[(n, length)]
        print(f"{f'{n}x{length}':<14}paired, median of {args.repeats} repeats: packed/serial {pair['serial']:.2f}, "
              f"packed/one-big {pair['big']:.2f}")
    print(f"cycle planning time / cycle time (packed run): {share:.4f}")
    dtype = resolve_dtype(args.dtype, "cpu")  # the base products' dtype (LoRA's few FLOPs are fp32 in both)
    rate = gemm_gflops(args.threads, dtype=dtype)
    cfg = ModelConfig.from_dir(CACHE / MODEL_DIRS[key])
    print(f"packed rounds against the arithmetic floor ({dtype} GEMM at {rate:.0f} GFLOP/s, {args.threads} threads):")
    print(f"{'tokens/tenant':<14}{'round s':>9}{'cycles s':>10}{'cycles':>8}{'passes':>8}{'floor s':>9}"
          f"{'floor/round':>12}   overhead ms/tenant-step: {'vs floor':>9}{'outside cycles':>15}{'vs one-big':>11}")
    for n, length in shapes:
        p, b = rows[("packed", n, length)], rows[("big", n, length)]
        floor = args.tenants * n * length * train_flops_per_token(cfg, RANK, length) / (rate * 1e9)
        per = [1e3 * (p["round_s"] - x) / args.tenants for x in (floor, p["cycle_s"], b["round_s"])]
        print(f"{f'{n}x{length}':<14}{p['round_s']:>9.2f}{p['cycle_s']:>10.2f}{p['cycles']:>8.1f}{p['passes']:>8.1f}"
              f"{floor:>9.2f}{floor / p['round_s']:>12.2f}{'':>28}{per[0]:>9.0f}{per[1]:>15.0f}{per[2]:>11.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="both", choices=["tiny", "smollm2", "both"])
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="steps per tenant in one measured run")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per case (the median is printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="the pools' base weights (auto: what lathe serve chooses on this machine)")
    ap.add_argument("--cycle-tokens", type=int, default=2048, help="the trainer's cycle capacity")
    ap.add_argument("--shapes", default="1x32,1x128,4x128", help="tokens per tenant, e.g. 1x32,4x128")
    ap.add_argument("--snapshot-every", type=int, help="the trainer's --snapshot-every (default: the trainer's own)")
    args = ap.parse_args()
    for key in (["tiny", "smollm2"] if args.model == "both" else [args.model]):
        run_model(key, args)


if __name__ == "__main__":
    main()
