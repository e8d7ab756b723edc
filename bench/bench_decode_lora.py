"""A decode step's LoRA over several adapters: the grouped tiles against Lathe's kernel on frozen adapters.

A batch decode step of the sampler holds a few rows per adapter (32 sequences over 4 adapters: 8 rows each). Every
target's correction used to run grouped (``lathe.kernels.lora_grouped``: each segment padded to 16-row tiles, one
batched product over per-tile copies of the adapters' weights). A sampler's adapters are frozen
(``LoraWeights.frozen``), so their column-major copies can be kept (``LoraWeights.columns``) and each segment's two
products run in one call of Lathe's fixed-order kernel (``chain.chain_lora``, register panels of up to 6 rows),
where the rank's ladder admitted it (``LoraBatch._chained``). This script times one SmolLM2 layer's seven targets
both ways (the same tensors, thawed copies of the adapters taking the grouped way), alternating, and says whether
the corrections are bitwise equal, beside the floor: the products' multiply-adds at this machine's GEMM rate and
the adapters' bytes at its read rate.

Run it alone: other processes on the same cores distort these timings badly.
Run: .venv/bin/python bench/bench_decode_lora.py [--adapters 4 --rows 8 --rank 32 --repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from machine import cpu_line, gemm_gflops, read_gbps

from lathe.models import tiles
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.lora_batch import LoraBatch

TARGETS = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
           "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
"""SmolLM2-135M's LoRA targets of one layer: (in, out)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="decode rows per adapter")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    rank = args.rank
    frozen = [LoraWeights(LoraSpec(rank=rank, alpha=16),
                          {(0, t): torch.randn(rank, i, generator=gen) * 0.05 for t, (i, _) in TARGETS.items()},
                          {(0, t): torch.randn(o, rank, generator=gen) * 0.05 for t, (_, o) in TARGETS.items()},
                          frozen=True) for _ in range(args.adapters)]
    thawed = [LoraWeights(w.spec, w.a, w.b) for w in frozen]
    ins, outs = sorted({i for i, _ in TARGETS.values()}), sorted({o for _, o in TARGETS.values()})
    ladder = tiles.choose_ladder([torch.randn(rank, i, generator=gen) for i in ins]
                                 + [torch.randn(o, rank, generator=gen) for o in outs], [1, 2])
    seg = [j * args.rows for j in range(args.adapters + 1)]
    ids = list(range(args.adapters))
    xs = {i: torch.randn(seg[-1], i, generator=gen) for i in ins}

    def layer(adapters: list[LoraWeights]) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            batch = LoraBatch(seg, ids, adapters)  # as a step builds it
            with torch.no_grad():
                return [batch.delta((0, t), xs[i], {rank: ladder}) for t, (i, _) in TARGETS.items()]
        return run

    ways = {"grouped tiles": layer(thawed), "lathe kernel": layer(frozen)}
    same = all(torch.equal(a, b) for a, b in zip(ways["grouped tiles"](), ways["lathe kernel"](), strict=True))
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, run in ways.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    fma = sum(seg[-1] * rank * (i + o) for i, o in TARGETS.values())
    weight_bytes = sum(rank * (i + o) * 4 for i, o in TARGETS.values()) * args.adapters
    gflops, gbps = gemm_gflops(2), read_gbps()
    floor_ms = max(2 * fma / gflops / 1e6, weight_bytes / gbps / 1e6)
    print(f"one SmolLM2 layer's LoRA (7 targets), {args.adapters} adapters x {args.rows} decode rows, rank {rank}, "
          f"fp32, 2 threads, kernel block {ladder.chain} (0: not admitted), {cpu_line()}")
    for name, values in times.items():
        print(f"  {name:<14}{statistics.median(values) * 1e3:7.2f} ms (median of {args.repeats})")
    ratio = statistics.median(times["grouped tiles"]) / statistics.median(times["lathe kernel"])
    print(f"  grouped / kernel: {ratio:.2f}x; corrections bitwise equal: {same}")
    print(f"  floor: {2 * fma / 1e6:.1f} MFLOP at {gflops:.0f} GFLOP/s, {weight_bytes / 1e6:.1f} MB at {gbps:.1f} GB/s "
          f"-> {floor_ms:.3f} ms; the kernel is {statistics.median(times['lathe kernel']) * 1e3 / floor_ms:.1f}x it")


if __name__ == "__main__":
    main()
