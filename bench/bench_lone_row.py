"""A lone decode row in fp32: the padded tile against Lathe's own fixed-order product (``lathe.kernels.chain``).

A sequence decoding alone runs every base linear, every LoRA product and the LM head on one row. An invariant
``linear`` must give that row its reference tile's bits, and the library computes one row with other bits, so
the row used to be zero-padded to a 4-row tile (for which MKL packs the whole weight again) or run in a 4-row
tile of the ladder. Where a pool's trial finds that Lathe's own kernel reproduces the tile's order
(``lathe.models.tiles.choose_chain``), the row runs through it instead, reading each weight once.

With ``--attention`` it times invariant decode attention (one layer of SmolLM2's heads, 1 and 32 sequences, a few
context lengths) through the library's small products against Lathe's kernel reading the paged blocks in place
(``attention.decode_attention(..., chain=, table=)``), beside the floor of reading those keys and values once, and
decodes one sequence in a ``SamplerEngine`` with the kernel and without it, alternating.

This script prints, over every layer weight and the LM head of SmolLM2-135M streamed from memory (as in decode):
the ways a pool can run a lone row, in ms per pass, and whether each gives the reference tile's bits; beside
them the memory floor (the weights' bytes at this machine's measured read bandwidth) and a plain 1-row product
(what transformers runs, with other bits). With ``--decode`` it first decodes one sequence (one rank-32 adapter on
every target and the head) in a ``SamplerEngine`` with the pool's chosen ladders and with the kernel taken out of
them, alternating in one process, and prints ms per token, the ratio, and whether tokens and logprobs are equal.

Run it alone: other processes on the same cores distort these timings badly.
Run: .venv/bin/python bench/bench_lone_row.py [--decode --attention --repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
from bench_prepacked import CACHE, Way, best_ms, decode_ab
from machine import cpu_line, read_gbps

from lathe.kernels import attention as attn
from lathe.kernels import chain, ops, tiling
from lathe.models import attention_tiles, tiles
from lathe.models.decoder import Decoder, layer_weight_names
from lathe.models.smollm2 import import_smollm2


def _chain_ways(model: Decoder) -> dict[str, Way]:
    with_chain = (model.ladder, dict(model.lora_ladders))
    without = (dataclasses.replace(model.ladder, chain=0, lone=tiles.choose_lone(
                   model, dataclasses.replace(model.ladder, chain=0), tiles.default_threads(model)).lone),
               {rank: dataclasses.replace(ladder, chain=0) for rank, ladder in model.lora_ladders.items()})
    print(f"pool's ladder {model.ladder}; LoRA ladders {model.lora_ladders}")

    def use(ladders: tuple[tiling.Ladder, dict[int, tiling.Ladder]]) -> Way:
        def set_way(m: Decoder) -> None:
            m.ladder, m.lora_ladders = ladders[0], dict(ladders[1])
        return set_way

    return {"lathe kernel": use(with_chain), "without it": use(without)}


def _attention_ways(model: Decoder) -> dict[str, Way]:
    block = model.attn_chain
    print(f"pool's decode attention kernel block: {block} (0: not admitted)")

    def use(b: int) -> Way:
        def set_way(m: Decoder) -> None:
            m.attn_chain = b
        return set_way

    return {"lathe kernel": use(block), "without it": use(0)}


def attention_table(repeats: int) -> None:
    """One layer's decode attention (SmolLM2: 9 query heads, 3 kv heads of 64), library products vs the kernel on
    paged blocks, per sequence count and context length, and the floor of reading the keys and values once."""
    torch.set_num_threads(2)
    block = attention_tiles.choose_attention_chain(9, 3, 64, torch.float32, torch.device("cpu"), [1, 2])
    gbps = read_gbps()
    print(f"decode attention, one layer (Hq 9, Hkv 3, D 64), fp32, 2 threads, kernel block {block}, {cpu_line()}")
    print(f"{'seqs':>5}{'context':>9}{'library us':>12}{'kernel us':>11}{'ratio':>7}{'floor us':>10}  same bits")
    gen = torch.Generator().manual_seed(0)
    for seqs in (1, 32):
        for context in (64, 256, 1024):
            chunks = context // chain.KEY_CHUNK
            blocks = [torch.randn(seqs * chunks + 1, chain.KEY_CHUNK, 3, 64, generator=gen) for _ in range(2)]
            table = torch.randperm(seqs * chunks, generator=gen).add(1).view(seqs, chunks)
            q, pos = torch.randn(seqs, 9, 64, generator=gen), torch.full((seqs,), context - 1)
            run = functools.partial(attn.decode_attention, q, *blocks, pos, scale=0.125, invariant=True, table=table)
            same = torch.equal(run(chain=0), run(chain=block)) if block else False
            lib, kernel = (best_ms(functools.partial(run, chain=b), repeats) * 1e3 for b in (0, block))
            floor = 2 * seqs * context * 3 * 64 * 4 / gbps / 1e3
            print(f"{seqs:>5}{context:>9}{lib:>12.0f}{kernel:>11.0f}{lib / kernel:>7.2f}{floor:>10.1f}  {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode", action="store_true", help="also decode one sequence in a SamplerEngine, both ways")
    ap.add_argument("--attention", action="store_true", help="decode attention: library products vs the kernel")
    args = ap.parse_args()
    path = import_smollm2(CACHE)
    # the engine's decodes first: the products below run on this thread, whose OpenMP team would then slow the engine's
    for asked, ways in ((args.decode, _chain_ways), (args.attention, _attention_ways)):
        if asked:
            ms = decode_ab(path, "float32", ways)
            print(f"  without / with the kernel: {ms['without it'] / ms['lathe kernel']:.2f}x")
    if args.attention:
        attention_table(args.repeats)
        return
    torch.set_num_threads(2)
    model = Decoder.from_dir(path)
    weights = [model.w[n] for n in layer_weight_names(model.cfg)] + [model.lm_head]
    trial = tiles.choose_ladder(tiles.model_weights(model), [1, 2])
    gen = torch.Generator().manual_seed(0)
    rows = {k: torch.randn(1, k, generator=gen) for k in {w.shape[1] for w in weights}}
    ways = {
        "4-row padded tile": lambda w, x: ops.direct_tile(torch.nn.functional.pad(x, (0, 0, 0, 3)), w.t())[:1],
        "4-row ladder tile": lambda w, x: ops.tiled_matmul(x, w.t(), tile=4),
        f"lathe kernel (block {trial.chain})": lambda w, x: chain.chain_matmul(x, w.t(), trial.chain),
        "1-row plain (other bits)": lambda w, x: x @ w.t(),
    }
    if not trial.chain:
        del ways[f"lathe kernel (block {trial.chain})"]
    streamed = sum(w.numel() * w.element_size() for w in weights)
    gbps = read_gbps()
    print(f"SmolLM2-135M fp32, {len(weights)} weights ({streamed / 1e6:.0f} MB), 2 threads, {cpu_line()}")
    print(f"memory floor: {streamed / 1e6:.0f} MB at {gbps:.1f} GB/s (measured) = {streamed / gbps / 1e6:.1f} ms")
    with torch.no_grad():
        ref = [ops.tiled_matmul(rows[w.shape[1]], w.t()) for w in weights]
        for name, way in ways.items():
            ms = best_ms(lambda way=way: [way(w, rows[w.shape[1]]) for w in weights], args.repeats)
            same = all(torch.equal(way(w, rows[w.shape[1]]), r) for w, r in zip(weights, ref, strict=True))
            print(f"  {name:<28}{ms:8.1f} ms  {streamed / ms / 1e6:5.1f} GB/s  reference bits: {same}")


if __name__ == "__main__":
    main()
