"""A lone decode row's base products: the zero-padded direct tile vs oneDNN's prepacked weights.

A sequence decoding alone runs every base linear on one row. Where the self-check admits no direct height of 1
(bf16 on an AVX-512 EPYC: the smallest admitted height is 4), the row is zero-padded to a 4-row direct tile, and
the library packs each weight again for every product. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and multiply by the packed copy (``_linear_pointwise``); a sampling
pool does so where its trial admits it (``lathe.models.tiles.choose_packed``). This script runs, over every layer
weight of SmolLM2-135M (streamed from memory, as in decode): the 4-row product as the pool runs it, the same rows
through the prepacked weights, and a plain 1-row product (what transformers runs), and says whether the prepacked
rows are bitwise the 4-row tile's at each thread count (what the pool checks first). Best of --repeats, each way
in turn.

Run it alone: other processes on the same cores distort these timings badly.
Run: .venv/bin/python bench/bench_prepacked.py [--dtype bfloat16 --threads 1 2 --repeats 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from machine import cpu_line

from lathe.models.decoder import Decoder
from lathe.models.smollm2 import import_smollm2

CACHE = Path(".cache/lathe")


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model = Decoder.from_dir(import_smollm2(CACHE), dtype=getattr(torch, args.dtype))
    weights = [w for name, w in model.w.items() if name.endswith("proj.weight")]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in weights]
    rows = {k: torch.randn(4, k, generator=torch.Generator().manual_seed(k)).to(weights[0].dtype)
            for k in {w.shape[1] for w in weights}}
    print(f"SmolLM2-135M, {len(weights)} layer weights, {args.dtype}, {cpu_line()}")
    print(f"{'threads':<8}{'4-row tile ms':>14}{'prepacked ms':>13}{'1-row ms':>10}{'tile/prepacked':>15}"
          f"{'same bits':>11}")
    with torch.no_grad():
        for n in args.threads:
            torch.set_num_threads(n)
            plain = [rows[w.shape[1]] @ w.t() for w in weights]
            same = all(torch.equal(torch.ops.mkldnn._linear_pointwise(rows[w.shape[1]], p, None, "none", [], ""), y)
                       for w, p, y in zip(weights, packed, plain, strict=True))
            tile = best_ms(lambda: [rows[w.shape[1]] @ w.t() for w in weights], args.repeats)
            pre = best_ms(lambda: [torch.ops.mkldnn._linear_pointwise(rows[w.shape[1]], p, None, "none", [], "")
                                   for w, p in zip(weights, packed, strict=True)], args.repeats)
            one = best_ms(lambda: [rows[w.shape[1]][:1] @ w.t() for w in weights], args.repeats)
            print(f"{n:<8}{tile:>14.1f}{pre:>13.1f}{one:>10.1f}{tile / pre:>15.2f}{str(same):>11}")
    streamed = sum(w.numel() * w.element_size() for w in weights)
    print(f"weights streamed per pass: {streamed / 1e6:.0f} MB (at 45 GB/s: {streamed / 45e9 * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
