"""lathe.kernels.lora_grouped: one grouped shrink and expand per target, with the per-segment path's bits.

The forward is compared bitwise with ``LoraBatch.delta_per_segment`` (the reference: each segment through
its own ``ops.linear`` pair) over layouts with short, tile-sized and long segments, several adapters and
ranks, an adapter that lacks the target, and a vocabulary-wide expand cut into column blocks. Gradients are
compared with autograd through the reference (to rounding), and a segment's gradients alone with the same
segment among others (bitwise: an adapter's training must not depend on its batch mates). Also the invariant
linear's and attention's own backward passes.
"""

from __future__ import annotations

import pytest
import torch

from lathe.kernels import attention as attn
from lathe.kernels import ops, tiling
from lathe.kernels.lora_grouped import STACK_BYTES, TileLayout
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.lora_batch import LoraBatch, _lone_tile
from lathe.models.tiles import choose_direct_tiles, choose_row_tiles

KEYS = {(0, "q_proj"): (96, 96), (0, "down_proj"): (1536, 96), (-1, "lm_head"): (96, 49152)}


def adapter(rank: int, seed: int, attn: bool = True) -> LoraWeights:
    gen = torch.Generator().manual_seed(seed)
    keys = {k: v for k, v in KEYS.items() if attn or k[1] != "q_proj"}
    a = {k: torch.randn(rank, i, generator=gen).requires_grad_() for k, (i, _) in keys.items()}
    b = {k: (torch.randn(o, rank, generator=gen) * 0.1).requires_grad_() for k, (_, o) in keys.items()}
    return LoraWeights(LoraSpec(rank=rank, alpha=16.0, train_attn=attn), a, b)


def layout(lengths: list[int]) -> list[int]:
    seg = [0]
    for n in lengths:
        seg.append(seg[-1] + n)
    return seg


ADAPTERS = [(8, 1, True), (32, 2, True), (8, 3, True), (32, 4, False), (64, 5, True)]
LENGTHS, IDS = [5, 33, 1, 16, 40, 2, 0], [0, 1, 2, 3, 4, 0, 1]


@pytest.mark.parametrize("key", list(KEYS), ids=[k[1] for k in KEYS])
def test_grouped_forward_has_the_per_segment_bits_and_its_gradients(threads: int, key: tuple[int, str]) -> None:
    adapters = [adapter(*a) for a in ADAPTERS]
    seg = layout(LENGTHS)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(seg[-1], KEYS[key][0], generator=gen, requires_grad=True)
    batch = LoraBatch(seg, IDS, adapters)
    grouped, reference = batch.delta(key, x), batch.delta_per_segment(key, x)
    assert torch.equal(grouped, reference)
    if key[1] == "q_proj":  # the adapter without the target leaves its rows at zero
        assert not grouped[seg[3]:seg[4]].any()
    params = [x] + [t for w in adapters if key in w.a for t in (w.a[key], w.b[key])]
    g = torch.randn(grouped.shape, generator=gen)
    ours = torch.autograd.grad(grouped, params, g)
    theirs = torch.autograd.grad(reference, params, g)
    for a, b in zip(ours, theirs, strict=True):  # two fp32 orders of a sum over up to 49152 columns: rounding only
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(b.abs().max().item(), 1.0))


def test_a_segments_gradients_alone_equal_its_gradients_among_others(threads: int) -> None:
    adapters = [adapter(*a) for a in ADAPTERS]
    seg = layout(LENGTHS)
    gen = torch.Generator().manual_seed(3)
    for key, (width, _) in KEYS.items():
        x = torch.randn(seg[-1], width, generator=gen)
        g = torch.randn(seg[-1], KEYS[key][1], generator=gen)
        packed_x = x.clone().requires_grad_()
        w = adapters[IDS[4]]
        packed = torch.autograd.grad(LoraBatch(seg, IDS, adapters).delta(key, packed_x),
                                     [packed_x, w.a[key], w.b[key]], g)
        alone_x = x[seg[4]:seg[5]].clone().requires_grad_()
        alone_y = LoraBatch([0, LENGTHS[4]], [0], [w]).delta(key, alone_x)
        alone = torch.autograd.grad(alone_y, [alone_x, w.a[key], w.b[key]], g[seg[4]:seg[5]])
        assert torch.equal(alone[0], packed[0][seg[4]:seg[5]]), key
        assert torch.equal(alone[1], packed[1]) and torch.equal(alone[2], packed[2]), key


def test_an_adapter_in_two_segments_gets_both_gradients() -> None:
    w = adapter(8, 1)
    key = (0, "q_proj")
    x = torch.randn(30, 96, generator=torch.Generator().manual_seed(8), requires_grad=True)
    grouped = LoraBatch([0, 10, 30], [0, 0], [w]).delta(key, x)
    assert torch.equal(grouped, LoraBatch([0, 30], [0], [w]).delta_per_segment(key, x))
    ours = torch.autograd.grad(grouped.square().sum(), [w.a[key], w.b[key]])
    reference = LoraBatch([0, 30], [0], [w]).delta_per_segment(key, x)
    theirs = torch.autograd.grad(reference.square().sum(), [w.a[key], w.b[key]])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_many_tiles_of_wide_weights_run_one_product_per_segment() -> None:
    """Past STACK_BYTES of per-tile copies the products go segment by segment; the bits stay the reference's."""
    adapters = [adapter(32, s) for s in (1, 2)]
    key = (-1, "lm_head")
    lengths = [150, 170]
    tiles = sum(-(-n // tiling.ROW_TILE) for n in lengths)
    assert tiles * 32 * 49152 * 4 > STACK_BYTES
    x = torch.randn(sum(lengths), 96, generator=torch.Generator().manual_seed(7))
    batch = LoraBatch(layout(lengths), [0, 1], adapters)
    with torch.no_grad():
        assert torch.equal(batch.delta(key, x), batch.delta_per_segment(key, x))


def test_out_of_autograd_an_expand_too_wide_to_stack_runs_per_segment_on_the_ranks_ladder_with_the_same_bits(
        threads: int) -> None:
    """A decode step of several adapters: the LM head's expand cannot be stacked, so with a ladder for the rank
    the segments run one by one over it (direct products), with the grouped path's and the reference's bits."""
    adapters = [adapter(32, s) for s in (1, 2, 3, 4)]
    key = (-1, "lm_head")
    gen = torch.Generator().manual_seed(6)
    shapes = [torch.randn(32, 96, generator=gen), torch.randn(tiling.col_cap(32, 4), 32, generator=gen)]  # A, B's block
    ladder = tiling.Ladder((tiling.ROW_TILE,), choose_direct_tiles(shapes, [threads]), lone=0)
    batch = LoraBatch(layout([8, 8, 8, 8]), [0, 1, 2, 3], adapters)
    x = torch.randn(32, 96, generator=gen)
    # per segment where this machine admits direct heights for the rank (a CPU whose library rounds rows by height
    # admits none, and the grouped path runs)
    assert batch._per_segment(key, x, adapters, {32: ladder}) == bool(ladder.direct)
    assert not batch._per_segment(key, x, adapters, {})
    with torch.no_grad():
        reference = batch.delta_per_segment(key, x)
        assert torch.equal(batch.delta(key, x, {32: ladder}), reference)
        assert torch.equal(batch.delta(key, x), reference)  # grouped, as without a ladder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lone_decode_row_runs_both_products_in_one_padded_tile_with_the_reference_bits(
        threads: int, dtype: torch.dtype) -> None:
    """A decode step of one sequence: out of autograd, a row fewer than the ladder's smallest direct height runs its
    shrink and expand in one zero-padded direct tile each (the LM head's expand in its column blocks), with the
    bits of ``ops.linear``'s padded products, which the pool's self-check holds to the reference tile's."""
    one = adapter(32, 7)
    gen = torch.Generator().manual_seed(8)
    shapes = [torch.randn(32, 96, generator=gen), torch.randn(tiling.col_cap(32, 4), 32, generator=gen)]
    ladder = tiling.Ladder((tiling.ROW_TILE,), choose_direct_tiles(shapes, [threads]), lone=0)
    batch = LoraBatch([0, 1], [0], [one])
    for key, (inputs, _) in KEYS.items():
        x = torch.randn(1, inputs, generator=gen).to(dtype)
        assert _lone_tile(ladder, 1, x, one.a[key]) == 0  # under autograd: ops.linear's differentiable products
        with torch.no_grad():
            # the padded tile where this machine admits direct heights (a CPU admitting none runs ops.linear's tiles)
            assert _lone_tile(ladder, 1, x, one.a[key]) == min(ladder.direct, default=0)
            lean = batch.delta_per_segment(key, x, {32: ladder})
            wide = x.float()
            v = ops.linear(wide, one.a[key], invariant=True, ladder=ladder)
            want = ops.linear(v * one.spec.scale, one.b[key], invariant=True, ladder=ladder)
        assert torch.equal(lean, want), key


def test_tile_layout_pads_each_segment_and_unpads_back() -> None:
    lay = TileLayout.build(40, [(0, 5, 0), (9, 30, 1)], 16, torch.device("cpu"))
    assert lay.tiles == 3 and lay.runs == ((0, 1, 0), (1, 3, 1)) and not lay.full
    x = torch.arange(40.0)[:, None].expand(40, 3).contiguous()
    padded = lay.pad(x)
    assert padded.shape == (3, 16, 3)
    assert padded[0, :5, 0].tolist() == [0, 1, 2, 3, 4] and not padded[0, 5:].any()
    assert padded[1, 0, 0] == 9 and padded[2, 4, 0] == 29 and not padded[2, 5:].any()
    back = lay.unpad(padded)
    assert torch.equal(back[:5], x[:5]) and torch.equal(back[9:30], x[9:30])
    assert not back[5:9].any() and not back[30:].any()


def test_segments_on_tile_boundaries_pad_without_gathers_and_keep_the_bits(threads: int) -> None:
    """A cycle of 32-token tenants packs segments that start on tile boundaries: the layout is ``aligned`` (no
    gathers), and its forward and gradients are bitwise those of the same rows in a layout that needs gathers."""
    assert TileLayout.build(37, [(0, 32, 0), (32, 37, 1)], 16, torch.device("cpu")).aligned
    assert not TileLayout.build(37, [(0, 5, 0), (5, 37, 1)], 16, torch.device("cpu")).aligned
    assert not TileLayout.build(40, [(0, 32, 0)], 16, torch.device("cpu")).aligned  # rows in no segment
    adapters = [adapter(8, s) for s in (1, 2, 3)]
    gen = torch.Generator().manual_seed(4)
    for key, (width, out) in KEYS.items():
        x = torch.randn(69, width, generator=gen)
        g = torch.randn(69, out, generator=gen)
        aligned, gathered = LoraBatch(layout([32, 32, 5]), [0, 1, 2], adapters), \
            LoraBatch(layout([5, 32, 32]), [2, 0, 1], adapters)
        order = torch.cat([torch.arange(5, 69), torch.arange(0, 5)])  # the same rows, the short segment first
        xa, xg = x.clone().requires_grad_(), x[order.argsort()].clone().requires_grad_()
        ya, yg = aligned.delta(key, xa), gathered.delta(key, xg)
        assert aligned._layout(key, 8, xa)[0].aligned and not gathered._layout(key, 8, xg)[0].aligned
        assert torch.equal(ya, yg[order]), key
        params = [t for w in adapters for t in (w.a[key], w.b[key])]
        da, dg = (torch.autograd.grad(y, [xx, *params], gg) for y, xx, gg in
                  ((ya, xa, g), (yg, xg, g[order.argsort()])))
        assert torch.equal(da[0], dg[0][order]), key
        for a, b in zip(da[1:], dg[1:], strict=True):
            assert torch.equal(a, b), key


@pytest.mark.parametrize("backward", ["reference", "chosen"])
def test_invariant_linear_gradients_do_not_depend_on_the_tile_ladder_the_batch_chose(threads: int,
                                                                                     backward: str) -> None:
    """A row's dX alone equals its dX in a 160-row batch, whose forward cuts 64-, 16- and 4-row tiles: with the
    reference backward tile, and with the backward ladder ``choose_row_tiles`` admits for the transposed
    products on this machine (what a trainer pool runs)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(576, 1536, generator=gen).t().contiguous().t()  # column-major, as the decoder stores it
    x, g = torch.randn(160, 1536, generator=gen), torch.randn(160, 576, generator=gen)
    ladder = (4, 16, 64)
    grad_tiles = (tiling.ROW_TILE,) if backward == "reference" else choose_row_tiles([weight.t()], [threads])
    full = x.clone().requires_grad_()
    forward, backward_ladder = tiling.Ladder(ladder), tiling.Ladder(grad_tiles)
    ops.linear(full, weight, invariant=True, ladder=forward, grad_ladder=backward_ladder).backward(g)
    for a, b in ((0, 1), (3, 10), (100, 160), (1, 130)):
        part = x[a:b].clone().requires_grad_()
        ops.linear(part, weight, invariant=True, ladder=forward, grad_ladder=backward_ladder).backward(g[a:b])
        assert torch.equal(part.grad, full.grad[a:b]), (a, b)
    ref = x.double().requires_grad_()
    (ref @ weight.double().t()).backward(g.double())
    torch.testing.assert_close(full.grad.double(), ref.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_keeps_its_forward_bits_under_autograd_and_its_gradients_match_sdpa(
        dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(70, h, 16, generator=gen).to(dtype).requires_grad_() for h in (6, 2, 2))
    out = attn.attention(q, k, v, q_offset=0, scale=0.25, invariant=True)
    with torch.no_grad():
        assert torch.equal(out, attn.attention(q, k, v, q_offset=0, scale=0.25, invariant=True))
    g = torch.randn(out.shape, generator=gen).to(dtype)
    ours = torch.autograd.grad(out, [q, k, v], g)
    theirs = torch.autograd.grad(attn.attention(q, k, v, q_offset=0, scale=0.25, invariant=False), [q, k, v], g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_bmm_into_out_has_the_bits_of_bmm(threads: int) -> None:
    """``ops._bmm(..., out=)`` (how per-run products land in their rows) writes what ``ops._bmm`` returns, for
    batches below the thread count (padded with zero products) and above it."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(96, 49152, generator=gen)
    for n in (1, 3):
        a = torch.randn(n, 16, 96, generator=gen)
        out = torch.full((n + 1, 16, 49152), float("nan"))
        got = ops._bmm(a, w.expand(n, *w.shape), out=out[1:])
        assert got.data_ptr() == out[1:].data_ptr()
        assert torch.equal(out[1:], ops._bmm(a, w.expand(n, *w.shape))) and out[0].isnan().all()
