"""A decode step's rows in fp32: the library's direct tiles against Lathe's kernel, row-major and over panels.

A sampling pool runs every row of a decode step of at most ``Ladder.chain_rows`` rows through Lathe's fixed-order
product (``lathe.kernels.chain``), over its weights' panels where it keeps them (``Decoder.panels``); the pool chooses
both by time among ways with the reference tile's bits (``tiles.choose_decode_rows``).

This script prints, for every layer weight and the LM head of SmolLM2-135M at 1 to 128 rows: ms per pass through
MKL's direct tiles (the ladder with ``chain_rows=0``; a lone row takes the kernel either way), through the kernel
walking the row-major weight, and through its panels; the GFLOP/s of each, whether all three give the same bits,
and the floor (the arithmetic at ``machine.gemm_gflops`` or the weights' bytes at ``machine.read_gbps``, whichever
is longer). Then, in one ``SamplerEngine`` (32 sequences over 4 rank-32 adapters), the decode step with the pool's
choices against the same without them (``chain_rows=0``, no panels), alternating, and whether the tokens agree.

Run it alone: other processes on the same cores distort these timings badly.
Run: .venv/bin/python bench/bench_decode_rows.py [--rows 1,8,32,64,128 --rounds 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import torch
from bench_prepacked import CACHE, best_ms
from bench_sampling import lathe_engine, lathe_generate, random_adapter, sampler_files
from machine import cpu_line, gemm_gflops, read_gbps

from lathe.kernels import chain, ops
from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder, layer_weight_names
from lathe.models.lora import UNEMBED
from lathe.models.pool import on_passing_thread
from lathe.models.smollm2 import import_smollm2


def products(model: Decoder, rows: list[int], repeats: int) -> None:
    ladder = model.ladder
    tiles_only = dataclasses.replace(ladder, chain_rows=0)
    weights = {n.removesuffix(".weight"): model.w[n] for n in layer_weight_names(model.cfg)} | {UNEMBED: model.lm_head}
    panels = model.panels or {name: chain.pack_panels(w) for name, w in weights.items()}
    gflops, gbps = gemm_gflops(2), read_gbps()
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    print(f"every layer weight and the LM head of SmolLM2-135M ({nbytes / 1e6:.0f} MB fp32), 2 threads; pool ladder "
          f"{ladder}; machine: {gflops:.0f} GFLOP/s, {gbps:.1f} GB/s")
    print(f"{'rows':>5} {'direct tiles ms':>16} {'kernel ms':>10} {'panels ms':>10} {'GFLOP/s (t/k/p)':>18} "
          f"{'floor ms':>9} {'panels/floor':>13} {'same bits':>10}")

    def run(way: str, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        if way == "tiles":
            return [ops.linear(xs[w.shape[1]], w, invariant=True, ladder=tiles_only) for w in weights.values()]
        return [chain.chain_linear(xs[w.shape[1]], w, ladder.chain, [], panels[n] if way == "panels" else None)
                for n, w in weights.items()]

    gen = torch.Generator().manual_seed(0)
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in sorted({w.shape[1] for w in weights.values()})}
        with torch.no_grad():
            outs = [run(way, xs) for way in ("tiles", "kernel", "panels")]
            same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*outs, strict=True))
            ms = [best_ms(functools.partial(run, way, xs), repeats) for way in ("tiles", "kernel", "panels")]
        flop = 2 * m * sum(w.numel() for w in weights.values())
        floor = max(flop / gflops / 1e6, nbytes / gbps / 1e6)
        rates = "/".join(f"{flop / t / 1e6:.0f}" for t in ms)
        print(f"{m:>5} {ms[0]:>16.1f} {ms[1]:>10.1f} {ms[2]:>10.1f} {rates:>18} {floor:>9.1f} {ms[2] / floor:>13.2f} "
              f"{same!s:>10}")


def decode_step(rounds: int, sequences: int = 32, new_tokens: int = 9) -> None:
    path = import_smollm2(CACHE)
    cfg = ModelConfig.from_dir(path)
    files = on_passing_thread(lambda: {f"tinker://bench-{i}/sampler_weights/s":
                                       sampler_files(random_adapter(cfg, 32, 100 + i)) for i in range(4)})
    paths = [list(files)[i % 4] for i in range(sequences)]
    prompts = torch.randint(cfg.vocab_size, (sequences, 32), generator=torch.Generator().manual_seed(0)).tolist()
    engine = lathe_engine(path, cfg, "float32", True, files, sequences)
    try:
        lathe_generate(engine, prompts, paths, 2)
        model = engine.base(engine.catalog.entries()[0].name).model
        chosen = (model.ladder, model.panels)
        ways = {"pool's choice": chosen, "without": (dataclasses.replace(model.ladder, chain_rows=0), {})}
        ms: dict[str, list[float]] = {way: [] for way in ways}
        tokens: dict[str, set[str]] = {way: set() for way in ways}
        for _ in range(rounds):
            for way, (ladder, panels) in ways.items():
                model.ladder, model.panels = ladder, panels
                start = time.perf_counter()
                lathe_generate(engine, prompts, paths, 1)
                mid = time.perf_counter()
                tokens[way].add(repr(lathe_generate(engine, prompts, paths, new_tokens)))
                ms[way].append(((time.perf_counter() - mid) - (mid - start)) / (new_tokens - 1) * 1e3)
    finally:
        engine.stop()
    print(f"decode step of {sequences} sequences over 4 rank-32 adapters in a SamplerEngine (chain_rows "
          f"{chosen[0].chain_rows}, {len(chosen[1])} panels), median of {rounds}:")
    for way, values in ms.items():
        print(f"  {way:<14} {statistics.median(values):6.1f} ms/step  (runs: {', '.join(f'{v:.0f}' for v in values)})")
    ratio = statistics.median(ms["without"]) / statistics.median(ms["pool's choice"])
    print(f"  ratio without / pool's choice: x{ratio:.2f}")
    print(f"  greedy tokens equal across ways and runs: {len(set().union(*tokens.values())) == 1}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64,128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(2)
    print(cpu_line())
    path = import_smollm2(CACHE)
    cfg = ModelConfig.from_dir(path)
    engine = lathe_engine(path, cfg, "float32", True, {"none": {}}, 1)  # the pool's own choices on this machine
    try:
        model = engine.base(engine.catalog.entries()[0].name).model
        products(model, [int(r) for r in args.rows.split(",")], args.repeats)
    finally:
        engine.stop()
    decode_step(args.rounds)


if __name__ == "__main__":
    main()
