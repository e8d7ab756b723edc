"""lathe.kernels.chain: Lathe's fixed-order product for a decode step's lone rows.

The kernel's order is checked against an exact emulation (every fused multiply-add rounded once, by rational
arithmetic), so these tests hold on any CPU; whether a pool may use it is checked where it matters, against the
reference tile's bits: admitted only where every row agrees, and where admitted, a lone row's linear and LoRA
correction have the reference bits."""

from __future__ import annotations

import dataclasses
import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from lathe.kernels import attention as attn
from lathe.kernels import chain, ops, tiling
from lathe.models import attention_tiles, tiles, trials
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.lora_batch import LoraBatch


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to the nearest fp32 (ties to even), by exact rational arithmetic."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.int32)) & 1))


def _emulated(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """The module docstring's order, element by element."""
    xs, ws = x.numpy(), w.numpy()
    y = np.zeros((x.shape[0], w.shape[1]), dtype=np.float32)
    for i in range(x.shape[0]):
        for j in range(w.shape[1]):
            total = np.float32(0)
            for k0 in range(0, x.shape[1], block):
                acc = np.float32(0)
                for k in range(k0, min(k0 + block, x.shape[1])):
                    acc = _fma32(xs[i, k], ws[k, j], acc)
                total = acc if k0 == 0 else np.float32(total + acc)
            y[i, j] = total
    return torch.from_numpy(y)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def test_the_kernel_runs_the_documented_order(gen: torch.Generator) -> None:
    x, w = torch.randn(2, 50, generator=gen), torch.randn(50, 7, generator=gen)
    for block in (16, 64):
        assert torch.equal(chain.chain_matmul(x, w, block), _emulated(x, w, block)), block
    # the block is part of the order: 16 and 64 round differently somewhere
    assert not torch.equal(chain.chain_matmul(x, w, 16), chain.chain_matmul(x, w, 64))


@pytest.mark.parametrize("n", [5, 300, 2100])
def test_rows_threads_and_layouts_leave_the_bits_alone(gen: torch.Generator, threads: int, n: int) -> None:
    x, w = torch.randn(3, 700, generator=gen), torch.randn(700, n, generator=gen)
    column_major = w.t().contiguous().t()  # [K, N] read as chains of a few columns
    ref = chain.chain_matmul(x, w, 192)
    with trials.at_threads(1):
        alone = torch.cat([chain.chain_matmul(x[i:i + 1], w, 192) for i in range(3)])
    assert torch.equal(alone, ref)
    assert torch.equal(chain.chain_matmul(x, column_major, 192), ref)
    assert torch.equal(chain.chain_matmul(x.t().contiguous().t(), w, 192), ref)  # rows made contiguous
    torch.testing.assert_close(ref.double(), x.double() @ w.double(), rtol=1e-5, atol=1e-4)


def test_chain_lora_is_both_products_in_one_call(gen: torch.Generator) -> None:
    x, a, b = torch.randn(2, 96, generator=gen), torch.randn(8, 96, generator=gen), torch.randn(130, 8, generator=gen)
    got = chain.chain_lora(x, a, b, 0.37, 64)
    want = chain.chain_matmul(chain.chain_matmul(x, a.t(), 64) * 0.37, b.t(), 64)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), (x.double() @ a.double().t()) * 0.37 @ b.double().t(),
                               rtol=1e-5, atol=1e-4)


def test_segments_in_one_call_have_each_segments_own_bits(gen: torch.Generator, threads: int) -> None:
    x = torch.randn(20, 96, generator=gen)
    segments = [(0, 5, torch.randn(8, 96, generator=gen), torch.randn(40, 8, generator=gen), 0.5, 64),
                (5, 1, torch.randn(16, 96, generator=gen), torch.randn(40, 16, generator=gen), 2.0, 32),
                (9, 11, torch.randn(8, 96, generator=gen).t().contiguous().t(),  # column-major, as a frozen copy
                 torch.randn(40, 8, generator=gen), 1.0, 64)]
    got = chain.chain_lora_segments(x, segments, 40)
    for r0, rows, a, b, scale, block in segments:
        assert torch.equal(got[r0:r0 + rows], chain.chain_lora(x[r0:r0 + rows], a, b, scale, block)), r0
    assert not got[6:9].any()  # rows of no segment stay zero
    with pytest.raises(ValueError, match=r"segment at row 18 of 5 rows with a \[8, 96\], b \[40, 8\] does not fit"):
        chain.chain_lora_segments(x, [(18, 5, *segments[0][2:])], 40)
    with pytest.raises(ValueError, match=r"segment at row 3 starts before row 5, where the one before it ends"):
        chain.chain_lora_segments(x, [segments[0], (3, 4, *segments[0][2:])], 40)


def test_a_linear_and_its_corrections_in_one_call_are_the_product_plus_the_segments(gen: torch.Generator,
                                                                                     threads: int) -> None:
    x, w = torch.randn(4, 96, generator=gen), torch.randn(96, 40, generator=gen).t().contiguous().t()
    segments = [(0, 1, torch.randn(8, 96, generator=gen), torch.randn(40, 8, generator=gen), 0.5, 64),
                (2, 2, torch.randn(16, 96, generator=gen).t().contiguous().t(), torch.randn(40, 16, generator=gen),
                 2.0, 32)]
    product = chain.chain_matmul(x, w, 192)
    got = chain.chain_linear(x, w.t(), 192, segments)
    assert torch.equal(got, product + chain.chain_lora_segments(x, segments, 40))  # row 1 of no segment adds zeros
    assert not torch.equal(got[2:], product[2:])
    assert torch.equal(chain.chain_linear(x, w.t(), 192, []), product)
    with pytest.raises(ValueError, match=r"chain_linear: x is \[4, 96\] but the weight is \[40, 95\]"):
        chain.chain_linear(x, w[:95].t(), 192, segments)
    with pytest.raises(ValueError, match=r"chain_linear: segment at row 3 of 2 rows"):
        chain.chain_linear(x, w.t(), 192, [(3, 2, *segments[0][2:])])


def test_bad_operands_are_refused_with_what_was_wrong() -> None:
    with pytest.raises(TypeError, match=r"fp32 CPU tensors, got torch.bfloat16 \[2, 4\]"):
        chain.chain_matmul(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 3), 64)
    with pytest.raises(ValueError, match=r"x is \[2, 4\] but w is \[5, 3\]"):
        chain.chain_matmul(torch.ones(2, 4), torch.ones(5, 3), 64)
    with pytest.raises(ValueError, match=r"a \[8, 5\]"):
        chain.chain_lora(torch.ones(2, 4), torch.ones(8, 5), torch.ones(3, 8), 1.0, 64)
    with pytest.raises(ValueError, match=r"block must be in \[1, 512\], got 1024"):
        chain.chain_matmul(torch.ones(2, 4), torch.ones(4, 3), 1024)


WEIGHTS = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
"""[N, K] weights of a SmolLM2 layer's shapes."""


def _weights(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for n, k in WEIGHTS]


def test_a_pool_admits_the_kernel_only_where_every_row_has_the_reference_tiles_bits(gen: torch.Generator) -> None:
    weights = _weights(gen)
    ladder = tiles.choose_ladder(weights, [1, 2])
    rows = torch.randn(5, 1536, generator=gen)

    def agrees(block: int) -> bool:
        return all(torch.equal(chain.chain_matmul(rows[:, :w.shape[1]], w.t(), block),
                               ops.tiled_matmul(rows[:, :w.shape[1]], w.t())) for w in weights)

    if not ladder.chain:  # refused here: then no block gives those bits (or the kernel cannot be built)
        assert not ladder.direct or not chain.available() or not any(agrees(b) for b in chain.BLOCKS)
        return
    assert ladder.direct and agrees(ladder.chain)
    for w in weights:  # a lone row's linear on the ladder takes the kernel, with the reference bits
        row = rows[:1, :w.shape[1]]
        got = ops.linear(row, w, invariant=True, ladder=ladder)
        assert torch.equal(got, ops.tiled_matmul(row, w.t()))
        assert torch.equal(got, ops.linear(row, w, invariant=True, ladder=dataclasses.replace(ladder, chain=0)))


def test_the_kernel_is_never_admitted_for_bf16_weights(gen: torch.Generator) -> None:
    weights = [torch.randn(n, 64, generator=gen).to(torch.bfloat16) for n in (64, 128)]  # the dtype refuses, any shape
    assert tiles.choose_chain(tiles._RowTrial(weights, [1], seed=0)) == 0


def test_a_lone_rows_lora_correction_in_one_call_keeps_the_ladders_bits(gen: torch.Generator) -> None:
    rank = 32
    shrinks = [torch.randn(rank, k, generator=gen) for k in (576, 1536)]
    expands = [torch.randn(n, rank, generator=gen) for n in (192, 576, 1536)]
    ladder = tiles.choose_ladder(shrinks + expands, [1, 2])
    key, one = (0, "down_proj"), LoraWeights(LoraSpec(rank=rank, alpha=16), {(0, "down_proj"): shrinks[1]},
                                             {(0, "down_proj"): expands[1] * 0.02})
    x = torch.randn(1, 1536, generator=gen)
    with torch.no_grad():
        got = LoraBatch([0, 1], [0], [one]).delta_per_segment(key, x, {rank: ladder})
        padded = dataclasses.replace(ladder, chain=0, lone=0)
        v = ops.linear(x, one.a[key], invariant=True, ladder=padded)
        want = ops.linear(v * one.spec.scale, one.b[key], invariant=True, ladder=padded)
    assert torch.equal(got, want)


def test_a_frozen_adapters_decode_segments_run_through_the_kernel_with_the_grouped_bits(gen: torch.Generator) -> None:
    rank, keys = 32, {(0, "up_proj"): (576, 1536), (0, "down_proj"): (1536, 576)}
    ladder = tiles.choose_ladder([torch.randn(rank, k, generator=gen) for k in (576, 1536)]
                                 + [torch.randn(n, rank, generator=gen) for n in (576, 1536)], [1, 2])
    adapters = [LoraWeights(LoraSpec(rank=rank, alpha=16),
                            {k: torch.randn(rank, i, generator=gen) for k, (i, _) in keys.items()},
                            {k: torch.randn(o, rank, generator=gen) * 0.02 for k, (_, o) in keys.items()}, frozen=True)
                for _ in range(3)]
    thawed = [LoraWeights(w.spec, w.a, w.b) for w in adapters]  # the same tensors, run the grouped way
    seg, ids = [0, 8, 16, 17, 50], [0, 1, 2, 0]  # two decode segments, a lone row, and one past CHAIN_SEGMENT_ROWS
    with torch.no_grad():
        for key, (width, _) in keys.items():
            x = torch.randn(seg[-1], width, generator=gen)
            got = LoraBatch(seg, ids, adapters).delta(key, x, {rank: ladder})
            assert torch.equal(got, LoraBatch(seg, ids, thawed).delta(key, x, {rank: ladder}))
            assert torch.equal(got, LoraBatch(seg, ids, thawed).delta_per_segment(key, x, {rank: ladder}))
    assert bool(adapters[1]._columns) == bool(ladder.chain)  # copies made only where the kernel runs
    with pytest.raises(ValueError, match="only a frozen adapter"):
        thawed[0].columns((0, "up_proj"))


def test_a_lone_decode_rows_linear_with_its_adapters_in_one_call_has_the_two_calls_bits(gen: torch.Generator,
                                                                                       tiny_dir: Path) -> None:
    """The decoder's fused way (``Decoder._chain_job``; a layer's q, k and v in one call, ``Decoder._linears``) against
    each product and correction run apart, on a ladder with the kernel: the same ops, so the same bits on any machine
    (whether a pool admits the kernel is tested above)."""
    model = Decoder.from_dir(tiny_dir)
    model.ladder = dataclasses.replace(model.ladder, direct=(4,), chain=64)
    rank, cfg = 8, model.cfg
    adapters = [LoraWeights.init(cfg, LoraSpec(rank=rank), seed) for seed in (1, 2)]
    adapters = [LoraWeights(w.spec, {k: a.detach() for k, a in w.a.items()},
                            {k: b.detach() + 0.02 * torch.randn(b.shape, generator=gen) for k, b in w.b.items()},
                            frozen=True) for w in adapters]
    model.lora_ladders = {rank: dataclasses.replace(model.ladder, chain=64)}
    name, key = "model.layers.0.mlp.down_proj", (0, "down_proj")
    weight = model.w[name + ".weight"]
    with torch.no_grad():
        for seg, ids in (([0, 1], [0]), ([0, 1, 3], [0, 1])):
            x = torch.randn(seg[-1], weight.shape[1], generator=gen)
            lora = LoraBatch(seg, ids, adapters)
            got = model._linear(x, name, key, lora)
            assert model._chain_job(x, name, weight, key, lora) is not None  # the fused way ran
            apart = ops.linear(x, weight, invariant=True, ladder=model.ladder) + lora.delta(key, x, model.lora_ladders)
            assert torch.equal(got, apart), seg
            h, prefix, targets = x[:, :cfg.hidden_size], "model.layers.0.self_attn.", ("q_proj", "k_proj", "v_proj")
            for t, y in zip(targets, model._linears(h, prefix, 0, targets, lora), strict=True):
                w = model.w[prefix + t + ".weight"]
                assert torch.equal(y, ops.linear(h, w, invariant=True, ladder=model.ladder)
                                   + lora.delta((0, t), h, model.lora_ladders)), (seg, t)
            assert torch.equal(model.logits(x[:, :cfg.hidden_size], lora),
                               ops.linear(x[:, :cfg.hidden_size], model.lm_head, invariant=True, ladder=model.ladder)
                               + lora.delta((-1, "lm_head"), x[:, :cfg.hidden_size], model.lora_ladders))
        assert model._chain_job(torch.randn(4, weight.shape[1]), name, weight, key, None) is None  # a tile's rows


def test_a_call_of_up_to_chain_rows_rows_runs_them_all_through_the_kernel(gen: torch.Generator) -> None:
    w = torch.randn(40, 96, generator=gen)
    ladder = tiling.Ladder(direct=(4,), chain=64, chain_rows=8)
    few, more = torch.randn(8, 96, generator=gen), torch.randn(9, 96, generator=gen)
    with torch.no_grad():
        assert torch.equal(ops.linear(few, w, invariant=True, ladder=ladder), chain.chain_matmul(few, w.t(), 64))
        assert ops.chained_block(few, w, invariant=True, ladder=ladder) == 64
        tiles_only = dataclasses.replace(ladder, chain_rows=0)  # more rows than chain_rows: the direct tiles
        assert torch.equal(ops.linear(more, w, invariant=True, ladder=ladder),
                           ops.linear(more, w, invariant=True, ladder=tiles_only))
        assert ops.chained_block(more, w, invariant=True, ladder=ladder) == 0
        assert ops.chained_block(few, w, invariant=True, ladder=tiles_only) == 0


def test_a_sampling_pool_times_its_decode_rows_only_among_ways_with_the_reference_bits(tiny_dir: Path) -> None:
    model, threads = Decoder.from_dir(tiny_dir), [1, 2]
    ladder = tiles.choose_ladder(tiles.model_weights(model), threads, tiles_too=True)
    got, panels = tiles.choose_decode_rows(model, ladder, threads, repeats=1)
    assert dataclasses.replace(got, chain_rows=0) == ladder  # only chain_rows is chosen here
    assert got.chain_rows in (0, *tiles.CHAIN_ROW_CANDIDATES) and (ladder.chain or not got.chain_rows)
    assert bool(panels) <= bool(got.chain_rows)  # panels only for a step that reads them
    for rows in {1, 3, got.chain_rows} - {0}:  # whatever time chose, the rows keep the reference tile's bits
        assert tiles.batch_failure(model, got, rows, threads) is None
    assert tiles.choose_decode_rows(model, dataclasses.replace(ladder, chain=0), threads) == (
        dataclasses.replace(ladder, chain=0), {})
    if panels:  # the decoder's step over them has the walk's bits
        model.ladder, model.panels = got, panels
        name, key = "model.layers.1.mlp.up_proj", (1, "up_proj")
        x = torch.randn(got.chain_rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            over = model._linear(x, name, key, None)
            model.panels = {}
            assert torch.equal(over, model._linear(x, name, key, None))


def test_a_product_over_a_weights_panels_has_the_row_major_walks_bits(gen: torch.Generator, threads: int) -> None:
    weight = torch.randn(40, 96, generator=gen).t().contiguous().t()  # [N, K] stored column-major, as the decoder's
    panels = chain.pack_panels(weight)
    assert panels.shape == (3, 96, chain.PANEL) and not panels[2, :, 8:].any()  # 40 columns: the last panel padded
    segments = [(1, 2, torch.randn(8, 96, generator=gen), torch.randn(40, 8, generator=gen), 0.5, 64)]
    for rows in (1, 5, 6, 13):
        x = torch.randn(rows, 96, generator=gen)
        assert torch.equal(chain.chain_linear(x, weight, 192, [], panels), chain.chain_matmul(x, weight.t(), 192))
        assert torch.equal(chain.chain_linear(x, weight, 192, segments[:rows > 2], panels),
                           chain.chain_linear(x, weight, 192, segments[:rows > 2]))
    with pytest.raises(ValueError, match=r"panels \[3, 95, 16\] \(torch.float32\) are not pack_panels of a weight"):
        chain.chain_linear(x, weight, 192, [], panels[:, :95].contiguous())


def _decode_case(gen: torch.Generator, positions: list[int], heads: int = 6, kv_heads: int = 2, d: int = 16,
                 slots: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [S, Hq, D] and a KV cache [S, slots, Hkv, D] with zeros past each sequence's position."""
    q = torch.randn(len(positions), heads, d, generator=gen)
    k, v = (torch.randn(len(positions), slots, kv_heads, d, generator=gen) for _ in range(2))
    for s, p in enumerate(positions):
        k[s, p + 1:], v[s, p + 1:] = 0, 0
    return q, k, v, torch.tensor(positions)


def test_decode_attention_kernel_runs_the_documented_order(gen: torch.Generator) -> None:
    positions, block, scale = [3, 64, 200], 8, 0.25  # a block under D: two chains a product
    q, k, v, pos = _decode_case(gen, positions)
    x = chain.attention_scores(q, k, pos, scale, block)
    p = torch.exp(x)
    o = chain.attention_values(p, p.sum(-1), v, pos, block)
    g = q.shape[1] // k.shape[2]
    for s, last in enumerate(positions):
        for h in range(k.shape[2]):
            rows = q[s, h * g:(h + 1) * g] * scale
            raw = torch.cat([chain.chain_matmul(rows, k[s, c * 64:(c + 1) * 64, h].t(), block) for c in range(4)], 1)
            raw[:, last + 1:] = float("-inf")
            want = (raw - raw.amax(1, keepdim=True)).view(g, 4, 64).transpose(0, 1)
            assert torch.equal(x[s, h], want), (s, h)
            seen = last // 64 + 1
            assert torch.isinf(x[s, h, seen:]).all()  # chunks past the end are -inf, never computed
            num, den = (chain.chain_matmul(p[s, h, 0], v[s, :64, h], block), p[s, h, 0].sum(-1, keepdim=True))
            for c in range(1, 4):  # chunk by chunk in order; a chunk past the end adds an exact zero
                part = chain.chain_matmul(p[s, h, c], v[s, c * 64:(c + 1) * 64, h], block) if c < seen else 0.0
                num, den = num + part, den + (p[s, h, c].sum(-1, keepdim=True) if c < seen else 0.0)
            assert torch.equal(o[s, h * g:(h + 1) * g], num / den), (s, h)
    reference = attn.decode_attention(q.double(), k.double(), v.double(), positions, scale=scale, invariant=False)
    torch.testing.assert_close(o.double(), reference, rtol=1e-5, atol=1e-5)


def test_decode_attention_kernel_bits_do_not_depend_on_the_batch_or_threads(gen: torch.Generator) -> None:
    positions = [0, 63, 64, 130, 255]
    q, k, v, pos = _decode_case(gen, positions)
    together = attn.decode_attention(q, k, v, pos, scale=0.25, invariant=True, chain=64)
    with trials.at_threads(1):
        for s, p in enumerate(positions):
            alone = attn.decode_attention(q[s:s + 1], k[s:s + 1, :64 * (p // 64 + 1)], v[s:s + 1, :64 * (p // 64 + 1)],
                                          [p], scale=0.25, invariant=True, chain=64)
            assert torch.equal(alone, together[s:s + 1]), p


def test_decode_attention_reads_a_paged_caches_blocks_in_place_with_the_same_bits(gen: torch.Generator) -> None:
    positions = [3, 130, 64]
    q, k, v, pos = _decode_case(gen, positions, slots=192)
    blocks = [torch.zeros(7, 64, *k.shape[2:]) for _ in range(2)]  # block 0 stays zeros: a table's padding
    table = torch.tensor([[5, 0, 0], [2, 6, 1], [4, 3, 0]])  # three sequences' blocks, scattered
    for s in range(3):
        for c in range(3):
            if table[s, c]:
                blocks[0][table[s, c]], blocks[1][table[s, c]] = k[s, c * 64:(c + 1) * 64], v[s, c * 64:(c + 1) * 64]
    for block in (0, 64):
        copied = attn.decode_attention(q, k, v, pos, scale=0.25, invariant=True, chain=block)
        paged = attn.decode_attention(q, *blocks, pos, scale=0.25, invariant=True, chain=block, table=table)
        assert torch.equal(paged, copied), block


def test_a_pool_admits_the_attention_kernel_only_where_it_has_the_librarys_bits(gen: torch.Generator) -> None:
    block = attention_tiles.choose_attention_chain(9, 3, 64, torch.float32, torch.device("cpu"), [1, 2])
    q, k, v, pos = _decode_case(gen, [5, 70, 191], heads=9, kv_heads=3, d=64)
    library = attn.decode_attention(q, k, v, pos, scale=0.125, invariant=True)
    if not block:  # refused here: then no block gives those bits (or the kernel cannot be built)
        assert not chain.available() or not any(
            torch.equal(attn.decode_attention(q, k, v, pos, scale=0.125, invariant=True, chain=b), library)
            for b in chain.BLOCKS)
        return
    assert torch.equal(attn.decode_attention(q, k, v, pos, scale=0.125, invariant=True, chain=block), library)
    assert attention_tiles.choose_attention_chain(9, 3, 64, torch.float32, torch.device("meta"), [1]) == 0


def test_bad_attention_operands_are_refused_with_what_was_wrong(gen: torch.Generator) -> None:
    q, k, v, pos = _decode_case(gen, [3], slots=100)
    with pytest.raises(ValueError, match=r"keys/values \[1, 100, 2, 16\] must be \[S, N, Hkv, D\] with N whole chunks"):
        chain.attention_scores(q, k, pos, 1.0, 64)
    q, k, v, pos = _decode_case(gen, [3])
    with pytest.raises(ValueError, match="positions must be a contiguous int64 CPU tensor, got torch.int32"):
        chain.attention_scores(q, k, pos.int(), 1.0, 64)
    with pytest.raises(TypeError, match=r"4-d fp32 CPU tensors, got torch.float64"):
        chain.attention_scores(q, k.double(), pos, 1.0, 64)
    x = chain.attention_scores(q, k, pos, 1.0, 64)
    with pytest.raises(ValueError, match=r"p \[1, 2, 3, 3, 64\] and den \[1, 2, 3, 3\] do not fit values"):
        chain.attention_values(x[:, :, :3], x[:, :, :3].sum(-1), v, pos, 64)


def test_without_a_compiler_pools_keep_the_padded_tile(no_compiler: None, gen: torch.Generator,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lathe.kernels.chain"):
        assert not chain.available()
    assert "no C compiler" in caplog.text
    assert tiles.choose_ladder(_weights(gen), [1]).chain == 0
    assert attention_tiles.choose_attention_chain(9, 3, 64, torch.float32, torch.device("cpu"), [1]) == 0
    with pytest.raises(RuntimeError, match="not available on this machine"):
        chain.chain_matmul(torch.ones(1, 4), torch.ones(4, 2), 64)
