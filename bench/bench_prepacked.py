"""A lone decode row's base products: the zero-padded direct tile vs oneDNN's prepacked weights.

A sequence decoding alone runs every base linear on one row. Where the self-check admits no direct height of 1
(bf16 on an AVX-512 EPYC: the smallest admitted height is 4), the row is zero-padded to a 4-row direct tile, and
the library packs each weight again for every product. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and multiply by the packed copy (``_linear_pointwise``); a sampling
pool does so where its trial admits it (``lathe.models.tiles.choose_packed``). This script runs, over every layer
weight of SmolLM2-135M (streamed from memory, as in decode): the 4-row product as the pool runs it, the same rows
through the prepacked weights, and a plain 1-row product (what transformers runs), and says whether the prepacked
rows are bitwise the 4-row tile's at each thread count (what the pool checks first). Best of --repeats, each way
in turn. With ``--decode``, it first decodes one sequence (one rank-32 adapter, 32-token prompt, 32 new tokens) in a
``SamplerEngine`` with the pool's prepacked copies and without them, alternating in one process, and prints the
median ms per token of each and whether their greedy tokens and sampled logprobs are equal.

Run it alone: other processes on the same cores distort these timings badly.
Run: .venv/bin/python bench/bench_prepacked.py [--dtype bfloat16 --threads 1 2 --repeats 7 --decode]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_sampling import BASE, TENANT, lathe_engine, lathe_generate, random_adapter, sampler_files
from machine import cpu_line

from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder
from lathe.models.pool import on_passing_thread
from lathe.models.smollm2 import import_smollm2
from lathe.sampler.engine import SamplerEngine
from lathe.v1 import lathe_pb2 as pb

CACHE = Path(".cache/lathe")


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


Way = Callable[[Decoder], None]
"""Sets one way of running a lone row on the pool's model (and restores nothing: the next way sets its own)."""


def decode_ab(path: Path, dtype: str, ways: Callable[[Decoder], dict[str, Way]], rounds: int = 4,
              new_tokens: int = 32) -> dict[str, float]:
    """A single-sequence decode (one rank-32 adapter, 32-token prompt) in a ``SamplerEngine``, each of ``ways(model)``
    in turn, alternating ``rounds`` times in one process; prints and returns each way's median ms per token, and
    whether every way's greedy tokens and sampled logprobs are equal."""
    torch.set_num_threads(2)
    cfg = ModelConfig.from_dir(path)
    adapter = "tinker://bench-0/sampler_weights/s"
    files = on_passing_thread(lambda: {adapter: sampler_files(random_adapter(cfg, 32, 100))})
    paths = list(files)
    prompts = torch.randint(cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).tolist()
    engine = lathe_engine(path, cfg, dtype, True, files, 1)
    try:
        lathe_generate(engine, prompts, paths, 3)
        model = engine.base(engine.catalog.entries()[0].name).model
        chosen = ways(model)
        ms: dict[str, list[float]] = {way: [] for way in chosen}
        outputs: dict[str, set[str]] = {way: set() for way in chosen}
        for _ in range(rounds):
            for way, set_way in chosen.items():
                set_way(model)
                start = time.perf_counter()
                tokens = lathe_generate(engine, prompts, paths, new_tokens + 1)[0]
                mid = time.perf_counter()
                lathe_generate(engine, prompts, paths, 1)  # the prompt's prefill and one token, taken off
                ms[way].append(((mid - start) - (time.perf_counter() - mid)) / new_tokens * 1e3)
                outputs[way].add(repr((tokens, sampled_logprobs(engine, prompts[0], paths[0]))))
    finally:
        engine.stop()
    print(f"single-sequence decode, {dtype}, 2 threads, {cpu_line()}")
    for way, values in ms.items():
        print(f"  {way:<14} {statistics.median(values):6.1f} ms/token  (runs: {', '.join(f'{v:.1f}' for v in values)})")
    same = len(set().union(*outputs.values())) == 1
    print(f"  greedy tokens and sampled logprobs equal across ways and runs: {same}")
    return {way: statistics.median(values) for way, values in ms.items()}


def sampled_logprobs(engine: SamplerEngine, prompt: list[int], path: str) -> list[float]:
    """The logprobs of 8 tokens sampled at temperature 1 with a fixed seed."""
    r = engine.sample(pb.SampleRequest(prompt=prompt, num_samples=1, tenant=TENANT, base_model=BASE, model_path=path,
                                       model_version=1.0, params=pb.SamplingParams(max_tokens=8, temperature=1.0,
                                                                                   top_p=1.0, use_eos=False, seed=3)))
    return list(r.result().sample.sequences[0].logprobs)


def _prepacked_ways(model: Decoder) -> dict[str, Way]:
    copies = dict(model.packed)

    def use(packed: dict[str, torch.Tensor]) -> Way:
        def set_way(m: Decoder) -> None:
            m.packed = packed
        return set_way

    print(f"{len(copies)} prepacked layer weights chosen by the pool")
    return {"prepacked": use(copies), "padded tile": use({})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--decode", action="store_true", help="also decode one sequence in a SamplerEngine, both ways")
    args = ap.parse_args()
    path = import_smollm2(CACHE)
    if args.decode:  # first: the products below run on this thread, whose OpenMP team would then slow the engine's
        decode_ab(path, args.dtype, _prepacked_ways)
    model = Decoder.from_dir(path, dtype=getattr(torch, args.dtype))
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
