"""Trainer pools: 1 rank vs. 2 ranks (gloo on CPU) on the same multi-tenant workload, side by side.

    python bench/bench_ranks.py [--model tiny|smollm2] [--tenants 4] [--steps 6] [--datums 8] [--length 64]

Each configuration runs the same operations: ``--tenants`` runs, each ``--steps`` forward_backward (``--datums``
datums of ``--length`` tokens) + optim_step pairs, all queued before the cycle thread starts, so every cycle
packs every tenant. This process is rank 0 (an in-process ``TrainerEngine``, no gRPC); rank 1 is a
``python -m lathe.trainer --rank 1`` process. Configurations:

- 1 rank, 1 thread      the pool of one, as every other benchmark runs it;
- 1 rank, N threads     the same process given every core (what 2 ranks compete against on a small machine);
- 2 ranks, 1 thread     a gloo pool: the cycle's adapters split over the ranks, gradients exchanged.

Prints per configuration: cycles, mean cycle time, tokens/s, and for the pool the share of the leader's cycle
time spent in collectives (the plan broadcast, the results gather and the gradient all_gather; a rank waiting
for a slower one waits inside them, so this share includes load imbalance). Checks that every configuration
ends with the same adapter weights, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import cpu_line

from lathe.models.catalog import ModelCatalog
from lathe.trainer import intake
from lathe.trainer.dist import Group, PoolConfig, free_port, join
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.v1 import lathe_pb2 as pb

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))
MODELS = {"tiny": "lathe/tiny-llama", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
ADAM = pb.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-12)


def ops(tenants: int, steps: int, datums: int, length: int) -> list[pb.TrainerOp]:
    out = []
    for t in range(tenants):
        rng = random.Random(t)
        for s in range(steps):
            data = []
            for _ in range(datums):
                tokens = [rng.randrange(1, 200) for _ in range(length)]
                arr = torch.tensor(tokens[1:] + tokens[:1]).numpy()
                data.append(pb.Datum(model_input=pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=tokens)]),
                                     loss_fn_inputs={"target_tokens": pb.Tensor(data=arr.tobytes(), dtype="int64",
                                                                                shape=[length])}))
            mid = f"t{t}"
            out.append(pb.TrainerOp(model_id=mid, seq_id=2 * s + 1, tenant=mid, request_id=f"{mid}-{2 * s + 1}",
                                    forward_backward=pb.ForwardBackwardRequest(model_id=mid, seq_id=2 * s + 1,
                                                                               data=data, loss_fn="cross_entropy")))
            out.append(pb.TrainerOp(model_id=mid, seq_id=2 * s + 2, tenant=mid, request_id=f"{mid}-{2 * s + 2}",
                                    optim_step=pb.OptimStepRequest(model_id=mid, seq_id=2 * s + 2, adam_params=ADAM)))
    return out


def run(base: str, args: argparse.Namespace, threads: int, group: Group | None) -> tuple[dict, dict[str, bytes]]:
    torch.set_num_threads(threads)
    cfg = TrainerConfig(models=base, cache_root=CACHE, cycle_tokens=args.tenants * args.datums * args.length)
    engine = TrainerEngine(cfg, ModelCatalog.from_spec(base, CACHE), None, group)
    for t in range(args.tenants):
        engine.create_adapter(pb.CreateAdapterRequest(model_id=f"t{t}", tenant=f"t{t}", base_model=base,
                                                      lora_config=pb.LoraConfig(rank=8, seed=t, train_attn=True,
                                                                                train_mlp=True)))
    work = ops(args.tenants, args.steps, args.datums, args.length)
    futures = [intake.submit(engine, op) for op in work]
    before = dict(group.seconds) if group is not None else {}
    t0 = time.perf_counter()
    engine.start()
    results = [f.result(timeout=1800) for f in futures]
    wall = time.perf_counter() - t0
    engine.stop()
    errors = [r.error.message for r in results if r.error is not None]
    if errors:
        raise SystemExit(f"operations failed: {errors[:3]}")
    cycles = max(r.receipt.cycle for r in results)
    tokens = args.tenants * args.steps * args.datums * args.length
    coll = sum(group.seconds[k] - before[k] for k in before) if group is not None else 0.0
    grads = group.seconds["all_gather"] - before["all_gather"] if group is not None else 0.0
    weights = {f"t{t}/{n}": p.detach().numpy().tobytes()
               for t in range(args.tenants) for n, p in engine.bank.get(f"t{t}").weights.named_parameters().items()}
    return {"cycles": cycles, "cycle_s": wall / cycles, "tok_s": tokens / wall, "coll": coll / wall,
            "grads": grads / wall}, b"".join(weights[k] for k in sorted(weights))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    args = ap.parse_args()
    base = MODELS[args.model]
    cores = os.cpu_count() or 1
    print(f"# trainer pool ranks, {base}; {args.tenants} tenants x {args.steps} steps x {args.datums}x{args.length} "
          f"tokens; {cpu_line()}", flush=True)
    rows = [("1 rank, 1 thread", *run(base, args, 1, None)),
            (f"1 rank, {cores} threads", *run(base, args, cores, None))]
    pool = PoolConfig(world_size=2, rank=0, master_port=free_port(), timeout_s=600)
    follower = subprocess.Popen([sys.executable, "-m", "lathe.trainer", "--models", base, "--cache-root", str(CACHE),
                                 "--threads", "1", "--world-size", "2", "--rank", "1",
                                 "--master-port", str(pool.master_port), "--rank-timeout-s", "600"])
    group = join(pool, "cpu")
    try:
        rows.append(("2 ranks, 1 thread each", *run(base, args, 1, group)))
    finally:
        follower.wait(timeout=60)
    print(f"{'configuration':<24} {'cycles':>6} {'cycle ms':>9} {'tokens/s':>9} {'vs 1x1':>7} {'collectives':>11} "
          f"{'grad all_gather':>15}")
    ref = rows[0][1]["tok_s"]
    for name, r, _ in rows:
        print(f"{name:<24} {r['cycles']:>6} {r['cycle_s'] * 1e3:>9.1f} {r['tok_s']:>9.0f} {r['tok_s'] / ref:>6.2f}x "
              f"{r['coll']:>10.1%} {r['grads']:>15.1%}")
    same = all(w == rows[0][2] for _, _, w in rows)
    print(f"final adapter weights identical across configurations: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
