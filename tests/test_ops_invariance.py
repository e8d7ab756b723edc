"""lathe.kernels.ops: float64 agreement in both modes, and batch invariance of rows in the invariant mode.

Invariance is checked bitwise (torch.equal): a row's result alone vs. inside batches of 1-40 rows, a lone tile's
rows vs. the same rows among other tiles, and products cut over the admitted tile heights vs. the reference tile.
Where plain torch breaks invariance on this machine, tests marked ``canary`` assert that it does, so the others can
fail. Prefill vs. decode (attention, a tiny decoder): tests/test_ops_invariance_decode.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from lathe.kernels import attention as attn
from lathe.kernels import ops, tiling
from lathe.models.tiles import choose_direct_tiles

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""Relative tolerance, and absolute tolerance as a fraction of the reference's largest magnitude."""


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _leaf(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def _check_values_and_grads(
    op: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], inputs: list[torch.Tensor]
) -> None:
    """op(*inputs) and its input gradients against reference(*float64 copies), for one upstream grad."""
    out = op(*inputs)
    upstream = torch.randn(out.shape, dtype=torch.float64)
    out.backward(upstream.to(out.dtype))
    wide = [t.detach().double().requires_grad_() for t in inputs]
    expected = reference(*wide)
    expected.backward(upstream)
    _assert_close(out, expected, out.dtype)
    for t, w in zip(inputs, wide, strict=True):
        _assert_close(t.grad, w.grad, t.dtype)


# ---------------------------------------------------------------- float64 references


def _attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float
) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    future = torch.arange(k.shape[0]) > q_offset + torch.arange(q.shape[0])[:, None]
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", weights, v)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / (x.square().sum(-1, keepdim=True) / x.shape[-1] + eps).sqrt()


def _log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    top = x.max(-1, keepdim=True).values
    return x - top - (x - top).exp().sum(-1, keepdim=True).log()


# ---------------------------------------------------------------- agreement with float64


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_float64_values_and_grads(invariant: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    inputs = [
        _leaf(3, 5, 64, dtype=dtype, gen=gen),
        _leaf(48, 64, dtype=dtype, gen=gen),
        _leaf(48, dtype=dtype, gen=gen),
    ]
    _check_values_and_grads(
        lambda x, w, b: ops.linear(x, w, b, invariant=invariant), lambda x, w, b: x @ w.T + b, inputs
    )


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_float64(invariant: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    inputs = [_leaf(2, 7, 96, dtype=dtype, gen=gen), _leaf(96, dtype=dtype, gen=gen)]
    _check_values_and_grads(
        lambda x, w: ops.rms_norm(x, w, 1e-5, invariant=invariant),
        lambda x, w: _rms_norm_reference(x, w, 1e-5),
        inputs,
    )


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_matches_float64_in_fp32(invariant: bool, dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, 1000, generator=torch.Generator().manual_seed(3)).mul(4).to(dtype)
    out = ops.log_softmax(x, invariant=invariant)
    assert out.dtype == torch.float32
    _assert_close(out, _log_softmax_reference(x.double()), torch.float32)


@pytest.mark.parametrize(("invariant", "tiles"), [(True, (attn.ATTN_ROW_TILE,)), (True, (4, 16, 64)), (False, ())],
                         ids=["invariant", "invariant-ladder", "plain"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lq", "lk", "q_offset"), [(100, 100, 0), (20, 75, 50), (1, 130, 129)], ids=["prefill", "chunked", "decode"]
)
def test_attention_matches_float64_values_and_grads(
    invariant: bool, tiles: tuple[int, ...], dtype: torch.dtype, lq: int, lk: int, q_offset: int
) -> None:
    gen = torch.Generator().manual_seed(4)
    inputs = [
        _leaf(lq, 6, 16, dtype=dtype, gen=gen),
        _leaf(lk, 2, 16, dtype=dtype, gen=gen),
        _leaf(lk, 2, 16, dtype=dtype, gen=gen),
    ]
    _check_values_and_grads(
        lambda q, k, v: attn.attention(q, k, v, q_offset=q_offset, scale=0.25, invariant=invariant, tiles=tiles),
        lambda q, k, v: _attention_reference(q, k, v, q_offset, 0.25),
        inputs,
    )


@pytest.mark.parametrize("tiles", [(attn.ATTN_ROW_TILE,), (attn.ATTN_ROW_TILE, *attn.ATTN_TILE_CANDIDATES)],
                         ids=["reference", "ladder"])
@pytest.mark.parametrize("length", [1, 33, 130])
def test_sequences_attended_together_have_the_bits_and_gradients_of_each_alone(
    threads: int, tiles: tuple[int, ...], length: int
) -> None:
    """``attention_batch`` over S sequences of one length: each output and each input gradient bitwise what
    ``attention`` gives the sequence alone, whatever S."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(5, length, h, 16, generator=gen).requires_grad_() for h in (6, 2, 2))
    dout = torch.randn(5, length, 6, 16, generator=gen)
    for count in (1, 2, 5):
        together = attn.attention_batch(q[:count], k[:count], v[:count], scale=0.25, invariant=True, tiles=tiles)
        grads = torch.autograd.grad(together, [q, k, v], dout[:count])
        for j in range(count):
            alone = attn.attention(q[j], k[j], v[j], q_offset=0, scale=0.25, invariant=True, tiles=tiles)
            assert torch.equal(alone, together[j]), (count, j)
            for mine, theirs in zip(torch.autograd.grad(alone, [q, k, v], dout[j]), grads, strict=True):
                assert torch.equal(mine[j], theirs[j]), (count, j)


def test_plain_attention_batch_matches_attention_per_sequence() -> None:
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(3, 20, h, 16, generator=gen) for h in (6, 2, 2))
    together = attn.attention_batch(q, k, v, scale=0.25, invariant=False)
    for j in range(3):
        alone = attn.attention(q[j], k[j], v[j], q_offset=0, scale=0.25, invariant=False)
        torch.testing.assert_close(together[j], alone, rtol=1e-5, atol=1e-6)


def test_attention_batch_rejects_bad_shapes() -> None:
    q, kv = torch.zeros(2, 4, 6, 16), torch.zeros(2, 5, 2, 16)
    with pytest.raises(ValueError, match=r"\[S, L, Hkv, D\]"):
        attn.attention_batch(q, kv, kv, scale=1.0, invariant=True)
    kv = torch.zeros(2, 4, 4, 16)
    with pytest.raises(ValueError, match="Hq=6"):
        attn.attention_batch(q, kv, kv, scale=1.0, invariant=True)


def test_attention_rejects_bad_shapes() -> None:
    q, kv = torch.zeros(4, 6, 16), torch.zeros(10, 4, 16)
    with pytest.raises(ValueError, match="Hq=6"):
        attn.attention(q, kv, kv, q_offset=0, scale=1.0, invariant=True)
    kv = torch.zeros(10, 2, 16)
    with pytest.raises(ValueError, match="q_offset=7"):
        attn.attention(q, kv, kv, q_offset=7, scale=1.0, invariant=False)


# ---------------------------------------------------------------- row invariance


def _rows_alone_vs_batched(op: Callable[[torch.Tensor], torch.Tensor], pool: torch.Tensor) -> list[int]:
    """Batch sizes M in 1..len(pool) at which some row of a random M-row batch differs from the row alone.

    Rows land in random positions (a fresh permutation per M), so every position of every M is used.
    """
    alone = torch.cat([op(pool[i : i + 1]) for i in range(len(pool))])
    gen = torch.Generator().manual_seed(len(pool))
    bad = []
    for m in range(1, len(pool) + 1):
        pick = torch.randperm(len(pool), generator=gen)[:m]
        if not torch.equal(op(pool[pick]), alone[pick]):
            bad.append(m)
    return bad


def _linear_rows(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 576 -> 256 linear's weight and bias, and a pool of 40 rows for it."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(256, 576, generator=gen).to(dtype), torch.randn(256, generator=gen).to(dtype)
    return weight, bias, torch.randn(40, 576, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_row_bits_do_not_depend_on_batch(threads: int, dtype: torch.dtype) -> None:
    weight, bias, pool = _linear_rows(dtype)
    assert _rows_alone_vs_batched(lambda x: ops.linear(x, weight, bias, invariant=True), pool) == []


@pytest.mark.canary
def test_plain_fp32_linear_row_bits_depend_on_batch(threads: int) -> None:
    """Measured: M in 1..3 (and 5..11 at 2 threads) break plain fp32 matmul, so the invariant linear's padding is
    tested. bf16: on the AVX2 development machine plain F.linear measured row-invariant for every M; the
    AVX-512-bf16 kernels of other machines need not be, so nothing is asserted about plain bf16."""
    weight, bias, pool = _linear_rows(torch.float32)
    plain = _rows_alone_vs_batched(lambda x: ops.linear(x, weight, bias, invariant=False), pool)
    assert plain, f"plain fp32 F.linear was row-invariant at {threads} thread(s); padding is untested"


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_over_a_tile_ladder_matches_float64_values_and_grads(dtype: torch.dtype) -> None:
    """300 rows over the ladder (1, 4, 16, 64, 256): 256 + 2 x 16 + 3 x 4 rows, each group its own tiles."""
    gen = torch.Generator().manual_seed(2)
    inputs = [_leaf(300, 64, dtype=dtype, gen=gen), _leaf(48, 64, dtype=dtype, gen=gen),
              _leaf(48, dtype=dtype, gen=gen)]
    ladder = (1, 4, 16, 64, 256)
    _check_values_and_grads(lambda x, w, b: ops.linear(x, w, b, invariant=True, ladder=tiling.Ladder(ladder)),
                            lambda x, w, b: x @ w.T + b, inputs)


@pytest.mark.parametrize(("rows", "tiles", "groups"), [
    (300, (16,), [(0, 300, 16)]),
    (300, (1, 4, 16, 64, 256), [(0, 256, 256), (256, 288, 16), (288, 300, 4)]),
    (63, (4, 16, 64, 256), [(0, 48, 16), (48, 63, 4)]),
    (3, (4, 16), [(0, 3, 4)]),
    (0, (16, 64), [(0, 0, 16)]),
])
def test_row_groups_cover_the_rows_largest_tiles_first(rows: int, tiles: tuple[int, ...],
                                                        groups: list[tuple[int, int, int]]) -> None:
    assert tiling.row_groups(rows, tiles) == groups


def test_row_groups_skip_a_height_that_fills_fewer_tiles_than_threads() -> None:
    """146 rows at 2 threads: one 128-row tile would run beside a zero tile; two 64-row tiles do the work."""
    assert tiling.row_groups(146, (16, 64, 128), least=2) == [(0, 128, 64), (128, 146, 16)]
    assert tiling.row_groups(146, (16, 64, 128)) == [(0, 128, 128), (128, 146, 16)]


@pytest.mark.parametrize(("k", "n", "size", "blocks"), [
    (576, 576, 4, [(0, 288), (288, 576)]),  # narrower than its cap: two halves
    (1536, 576, 4, [(0, 288), (288, 576)]),
    (256, 1536, 4, [(0, 768), (768, 1536)]),  # a LoRA expand of rank 256
    (32, 1536, 4, [(0, 1536)]),  # one of rank 32: under SPLIT_BYTES
    (576, 192, 4, [(0, 192)]),  # halves would be under SPLIT_WIDTH
    (576, 32, 4, [(0, 32)]),  # a LoRA shrink is never halved
    (576, 600, 4, [(0, 304), (304, 600)]),  # halves round up to 16 columns
    (576, 1792, 4, [(0, 1792)]),  # exactly its cap: the first block of a wider weight
    (576, 49152, 2, [(c, min(c + 3584, 49152)) for c in range(0, 49152, 3584)]),  # bf16: twice the columns
])
def test_col_blocks_halve_narrow_weights_and_cap_wide_ones(k: int, n: int, size: int,
                                                            blocks: list[tuple[int, int]]) -> None:
    assert tiling.col_blocks(k, n, size) == blocks
    assert all((c1 - c0) * k * size <= tiling.COL_BLOCK_BYTES for c0, c1 in blocks)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (576, 1560), (2048, 1300)])
def test_a_lone_tile_has_the_bits_of_the_same_rows_among_other_tiles(threads: int, dtype: torch.dtype, k: int,
                                                                      n: int) -> None:
    """One tile runs its column blocks in one bmm (equal halves; a narrower last block; blocks of the byte cap
    and a remainder), many tiles loop over the blocks: the products, and so the bits, are the same."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    assert len(tiling.col_blocks(k, n, w.element_size())) > 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = ops.tiled_matmul(x, w.t(), tile=16)
        for r0, r1 in ((0, 1), (5, 16), (16, 20)):
            assert torch.equal(ops.tiled_matmul(x[r0:r1], w.t(), tile=16), batch[r0:r1])
    finally:
        torch.set_num_threads(before)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(batch.double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * ref.abs().max().item())


def test_linear_keeps_leading_dims_and_invariant_rows_match_flat_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    x, weight = torch.randn(2, 3, 5, 64, generator=gen), torch.randn(24, 64, generator=gen)
    out = ops.linear(x, weight, invariant=True)
    assert out.shape == (2, 3, 5, 24)
    assert torch.equal(out[1, 2], ops.linear(x[1, 2], weight, invariant=True))


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_log_softmax_rows_do_not_depend_on_batch(
    threads: int, invariant: bool, dtype: torch.dtype
) -> None:
    """Measured row-invariant in plain torch as well, which is why both modes share their code."""
    gen = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(40, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    assert _rows_alone_vs_batched(lambda x: ops.rms_norm(x, weight, 1e-5, invariant=invariant), hidden) == []
    logits = torch.randn(40, 49152, generator=gen).mul(5).to(dtype)
    assert _rows_alone_vs_batched(lambda x: ops.log_softmax(x, invariant=invariant), logits) == []


def _lone_long_rows_differing(invariant: bool) -> int:
    """Of 20 seeds, how many give a 49152-wide row an rms_norm alone other than in a batch of 3. torch reduces a
    lone row of > 32768 elements in two parallel halves; a row in a batch in one pass."""
    width, differs = 49152, 0
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        batch, weight = torch.randn(3, width, generator=gen).mul(3), torch.ones(width)
        alone = ops.rms_norm(batch[1:2], weight, 1e-5, invariant=invariant)
        batched = ops.rms_norm(batch, weight, 1e-5, invariant=invariant)[1:2]
        differs += not torch.equal(batched, alone)
    return differs


def test_invariant_rms_norm_of_a_lone_long_row_equals_the_batchs(two_threads: None) -> None:
    assert _lone_long_rows_differing(invariant=True) == 0


@pytest.mark.canary
def test_plain_rms_norm_of_a_lone_long_row_differs_from_the_batchs(two_threads: None) -> None:
    assert _lone_long_rows_differing(invariant=False) > 0, \
        "plain rms_norm of a lone long row matched the batch for 20 seeds"


@pytest.mark.parametrize("lone", [tiling.ROW_TILE, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_products_mixing_the_admitted_heights_keep_the_reference_bits(dtype: torch.dtype, lone: int) -> None:
    """The self-check admits each direct height alone; a batch cut over all of them (largest first, the rows left
    over in the reference tile or zero-padded to a tile of the smallest height) still gives every row the 16-row
    tile's bits, at any row count and offset. Where this machine admits no height, ``direct_matmul`` is the
    reference tile itself."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(384, 320, generator=gen).to(dtype)  # [N, K]
    heights = choose_direct_tiles([weight], [1, 2])
    assert set(heights) <= set(tiling.DIRECT_TILE_CANDIDATES)
    x, w = torch.randn(700, 320, generator=gen).to(dtype), weight.t()
    ref = ops.tiled_matmul(x, w)
    for start, rows in ((0, 700), (3, 341), (5, 1), (9, 2), (17, 263)):
        got = ops.direct_matmul(x[start:start + rows], w, heights, lone)
        assert torch.equal(got, ref[start:start + rows]), (heights, start, rows)
