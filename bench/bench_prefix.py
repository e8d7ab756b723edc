"""Prefix reuse in the sampler's paged KV cache: a shared-prompt workload with and without it, side by side.

Workload: one request with a ``--shared``-token prompt (a system prompt) runs first; then ``--requests``
requests arrive at once, each that shared prompt plus ``--suffix`` tokens of its own, ``--max-tokens``
greedy tokens each. With the prefix cache they find the shared prompt's full blocks cached and prefill
only the rest; without it each prefills everything. Prints the burst's wall time both ways (median of
``--repeats``), the ratio, the prefix hits and misses, and checks that both ways sampled the same tokens
with the same logprob bits.

    python bench/bench_prefix.py               the tiny test model (written into --cache-root if missing)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from machine import cpu_line

from lathe.models.catalog import ModelCatalog
from lathe.models.tiny import ensure_tiny_model
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.v1 import lathe_pb2 as pb

BASE = "lathe/tiny-llama"


def request(prompt: list[int], max_tokens: int, i: int) -> pb.SampleRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
    return pb.SampleRequest(prompt=prompt, num_samples=1, params=params, tenant="t", base_model=BASE,
                            request_id=f"r{i}")


def run(args: argparse.Namespace, prefix_cache: bool) -> tuple[float, list[pb.SampleResult], dict[str, int]]:
    """The burst's wall time after the warm-up request, its results and the engine's KV stats."""
    rng = random.Random(0)
    shared = [rng.randrange(500) for _ in range(args.shared)]
    prompts = [shared + [rng.randrange(500) for _ in range(args.suffix)] for _ in range(args.requests)]
    cfg = SamplerConfig(models=BASE, cache_root=args.cache_root, device="cpu", prefix_cache=prefix_cache)
    engine = SamplerEngine(cfg, ModelCatalog.from_spec(BASE, args.cache_root))
    engine.start()
    try:
        engine.sample(request(shared + [1], args.max_tokens, -1)).result(timeout=600)
        t0 = time.perf_counter()
        futures = [engine.sample(request(p, args.max_tokens, i)) for i, p in enumerate(prompts)]
        results = [f.result(timeout=600) for f in futures]
        failed = [r.error.message for r in results if r.WhichOneof("result") != "sample"]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
        return time.perf_counter() - t0, results, engine.kv_stats()
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-root", type=Path, default=Path(".cache/lathe"))
    ap.add_argument("--shared", type=int, default=448, help="tokens of the shared prompt (7 blocks)")
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ensure_tiny_model(args.cache_root, "llama")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    outputs, stats = {}, {}
    for _ in range(args.repeats):
        for on in (True, False):
            s, outputs[on], stats[on] = run(args, on)
            seconds[on].append(s)
    same = [[(list(s.tokens), list(s.logprobs)) for s in r.sample.sequences] for r in outputs[True]] == \
           [[(list(s.tokens), list(s.logprobs)) for s in r.sample.sequences] for r in outputs[False]]
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"CPU: {cpu_line()}; torch threads {args.threads}")
    print(f"{args.requests} requests of {args.shared} shared + {args.suffix} own prompt tokens, "
          f"{args.max_tokens} new tokens each, after one warm-up request with the shared prompt")
    print(f"  prefix cache on : {on * 1e3:8.1f} ms   KV stats {stats[True]}")
    print(f"  prefix cache off: {off * 1e3:8.1f} ms   KV stats {stats[False]}")
    print(f"  off / on: {off / on:.2f}x; same tokens and logprob bits both ways: {same}")


if __name__ == "__main__":
    main()
