"""lathe.kernels.ops: float64 agreement in both modes, and batch invariance in the invariant mode.

Invariance is checked bitwise (torch.equal): a row's result alone vs. inside batches of 1-40 rows,
a token's attention in a causal prefill vs. decoded alone or in a chunked prefill, and a tiny
two-layer decoder's log-probabilities in one padded batch vs. teacher-forced decoding. Where plain
torch breaks invariance on this machine, tests marked ``canary`` assert that it does, so the others can fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lathe.kernels import attention as attn
from lathe.kernels import ops, tiling
from lathe.models.tiles import choose_attention_tiles, choose_direct_tiles

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


# ---------------------------------------------------------------- attention: prefill vs. decode


def _qkv(length: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, heads, 64, generator=gen).to(dtype) for heads in (9, 3, 3))
    return q, k, v


@pytest.mark.parametrize("ladder", ["reference", "chosen"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_attention_decode_and_chunked_prefill_equal_prefill(dtype: torch.dtype, ladder: str) -> None:
    """Prefill in the reference tile, or in the ladder this machine's self-check chooses, has decode's bits."""
    tiles = (attn.ATTN_ROW_TILE,)
    if ladder == "chosen":
        tiles = choose_attention_tiles(9, 3, 64, dtype, torch.device("cpu"), sorted({1, torch.get_num_threads()}))
    q, k, v = _qkv(150, dtype, seed=8)
    prefill = attn.attention(q, k, v, q_offset=0, scale=0.125, invariant=True, tiles=tiles)
    # A KV cache longer than the sequence, its spare slots holding any finite values: they never count.
    k_cache, v_cache = (torch.cat([x, torch.randn(106, 3, 64).to(dtype)]) for x in (k, v))
    for t in range(150):
        alone = attn.attention(q[t : t + 1], k[: t + 1], v[: t + 1], q_offset=t, scale=0.125, invariant=True)
        assert torch.equal(alone, prefill[t : t + 1]), f"decode of token {t} differs from prefill"
        cached = attn.attention(q[t : t + 1], k_cache, v_cache, q_offset=t, scale=0.125, invariant=True)
        assert torch.equal(cached, prefill[t : t + 1]), f"decode of token {t} from a long cache differs"
    for splits in ([0, 1, 2, 65, 129, 150], [0, 37, 64, 100, 150], [0, 63, 64, 128, 149, 150]):
        for s0, s1 in zip(splits, splits[1:], strict=False):
            part = attn.attention(q[s0:s1], k[:s1], v[:s1], q_offset=s0, scale=0.125, invariant=True, tiles=tiles)
            assert torch.equal(part, prefill[s0:s1]), f"chunked prefill {s0}:{s1} (splits {splits}) differs"


def test_invariant_attention_past_256_keys_where_one_long_matmul_would_break() -> None:
    """A single P @ V over all keys changes a row's bits once K passes 256 (measured); chunks must not."""
    q, k, v = _qkv(400, torch.float32, seed=13)
    prefill = attn.attention(q, k, v, q_offset=0, scale=0.125, invariant=True)
    for t in (255, 256, 300, 383, 399):
        alone = attn.attention(q[t : t + 1], k[: t + 1], v[: t + 1], q_offset=t, scale=0.125, invariant=True)
        assert torch.equal(alone, prefill[t : t + 1]), f"decode of token {t} differs from prefill"
    part = attn.attention(q[256:300], k[:300], v[:300], q_offset=256, scale=0.125, invariant=True)
    assert torch.equal(part, prefill[256:300])


@pytest.mark.canary
def test_plain_attention_decode_differs_from_prefill() -> None:
    """Measured here: SDPA gives 149 of 150 fp32 tokens different bits decoded alone than in prefill."""
    q, k, v = _qkv(150, torch.float32, seed=8)
    prefill = attn.attention(q, k, v, q_offset=0, scale=0.125, invariant=False)
    differing = [
        t
        for t in range(150)
        if not torch.equal(
            attn.attention(q[t : t + 1], k[: t + 1], v[: t + 1], q_offset=t, scale=0.125, invariant=False),
            prefill[t : t + 1],
        )
    ]
    assert differing, "plain attention was prefill/decode invariant; the invariant mode is untested"


def test_invariant_bits_do_not_depend_on_the_thread_count() -> None:
    """Trainer and sampler may run with different thread budgets. A lone tile's product, and a LoRA shrink
    with a long reduction (1536 -> 32: split across threads by MKL on AVX-512 Xeons when a batch holds fewer
    products than threads), keep their bits at 1, 2 and 4 threads."""
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(5, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    wide, shrink = torch.randn(40, 1536, generator=gen), torch.randn(32, 1536, generator=gen)
    q, k, v = _qkv(150, torch.float32, seed=12)
    before, results = torch.get_num_threads(), []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            prefill = attn.attention(q, k, v, q_offset=0, scale=0.125, invariant=True)
            decode = attn.attention(q[-1:], k, v, q_offset=149, scale=0.125, invariant=True)
            lone, batch = ops.linear(wide[:1], shrink, invariant=True), ops.linear(wide, shrink, invariant=True)
            assert torch.equal(lone, batch[:1])
            results.append((ops.linear(x, weight, invariant=True), prefill, decode, batch))
    finally:
        torch.set_num_threads(before)
    for one, *others in zip(*results, strict=True):
        assert all(torch.equal(one, other) for other in others)


# ---------------------------------------------------------------- a tiny decoder, batch vs. decode

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, EPS = 320, 96, 6, 2, 16, 160, 1e-6
SCALE = HEAD_DIM**-0.5
LENGTHS = [150, 97, 64, 5]


@dataclass
class _Layer:
    norm1: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    norm2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class _Tiny:
    embed: torch.Tensor
    layers: list[_Layer]
    norm: torch.Tensor
    head: torch.Tensor


def _tiny(dtype: torch.dtype) -> _Tiny:
    gen = torch.Generator().manual_seed(9)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / cols**0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)

    layers = [
        _Layer(
            norm(),
            w(HEADS * HEAD_DIM, HIDDEN),
            w(KV_HEADS * HEAD_DIM, HIDDEN),
            w(KV_HEADS * HEAD_DIM, HIDDEN),
            w(HIDDEN, HEADS * HEAD_DIM),
            norm(),
            w(INTERMEDIATE, HIDDEN),
            w(INTERMEDIATE, HIDDEN),
            w(HIDDEN, INTERMEDIATE),
        )
        for _ in range(2)
    ]
    return _Tiny(w(VOCAB, HIDDEN) * HIDDEN**0.5, layers, norm(), w(VOCAB, HIDDEN))


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _logprobs(model: _Tiny, tokens: torch.Tensor, attend: Attend, invariant: bool) -> torch.Tensor:
    """Log-softmax over the vocabulary for every token in tokens [...]; attend(layer, q, k, v) -> o."""
    x = model.embed[tokens]
    for i, layer in enumerate(model.layers):
        h = ops.rms_norm(x, layer.norm1, EPS, invariant=invariant)
        q, k, v = (
            ops.linear(h, w, invariant=invariant).unflatten(-1, (heads, HEAD_DIM))
            for w, heads in ((layer.q, HEADS), (layer.k, KV_HEADS), (layer.v, KV_HEADS))
        )
        x = x + ops.linear(attend(i, q, k, v).flatten(-2), layer.o, invariant=invariant)
        h = ops.rms_norm(x, layer.norm2, EPS, invariant=invariant)
        gate, up = (ops.linear(h, w, invariant=invariant) for w in (layer.gate, layer.up))
        x = x + ops.linear(F.silu(gate) * up, layer.down, invariant=invariant)
    h = ops.rms_norm(x, model.norm, EPS, invariant=invariant)
    logits = ops.linear(h, model.head, invariant=invariant)
    return ops.log_softmax(logits, invariant=invariant)


def _prefill_attend(invariant: bool) -> Attend:
    """Attention over a right-padded batch q [B, Lmax, Hq, D]: each sequence alone, padding left 0."""

    def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(q)
        for b, n in enumerate(LENGTHS):
            out[b, :n] = attn.attention(q[b, :n], k[b, :n], v[b, :n], q_offset=0, scale=SCALE, invariant=invariant)
        return out

    return attend


def _decode_attend(caches: list[torch.Tensor], live: list[int], t: int, invariant: bool) -> Attend:
    """Attention of decode step t for sequences `live` (row r is sequence live[r]), through KV caches."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = caches[layer]
        keys[live, t], values[live, t] = k, v
        rows = [
            attn.attention(
                q[r : r + 1],
                keys[b, : t + 1],
                values[b, : t + 1],
                q_offset=t,
                scale=SCALE,
                invariant=invariant,
            )
            for r, b in enumerate(live)
        ]
        return torch.cat(rows)

    return attend


def _batch_vs_decode_mismatches(dtype: torch.dtype, invariant: bool) -> int:
    """Tokens whose log-softmax row differs between one right-padded batch and teacher-forced decoding."""
    model, batch, longest = _tiny(dtype), len(LENGTHS), max(LENGTHS)
    tokens = torch.randint(VOCAB, (batch, longest), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        batched = _logprobs(model, tokens, _prefill_attend(invariant), invariant)
        caches = [torch.zeros(2, batch, longest, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in model.layers]
        mismatches = 0
        for t in range(longest):
            live = [b for b, n in enumerate(LENGTHS) if n > t]
            live = live[t % len(live) :] + live[: t % len(live)]  # a different batch order every step
            step = _logprobs(model, tokens[live, t], _decode_attend(caches, live, t, invariant), invariant)
            mismatches += sum(not torch.equal(step[r], batched[b, t]) for r, b in enumerate(live))
    return mismatches


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_decoder_logprobs_equal_in_batch_and_decode(dtype: torch.dtype) -> None:
    assert _batch_vs_decode_mismatches(dtype, invariant=True) == 0


@pytest.mark.canary
def test_plain_decoder_logprobs_differ_in_batch_and_decode() -> None:
    assert _batch_vs_decode_mismatches(torch.float32, invariant=False) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_attention_has_the_bits_of_per_sequence_attention(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 63, 64, 65, 150, 7]
    n = -(-max(lengths) // attn.KEY_CHUNK) * attn.KEY_CHUNK
    hq, hkv, d = 6, 2, 16
    k = torch.randn(len(lengths), n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(len(lengths), n, hkv, d, generator=gen).to(dtype)
    for s, length in enumerate(lengths):  # spare slots hold zeros, as in the sampler's cache
        k[s, length:] = 0
        v[s, length:] = 0
    q = torch.randn(len(lengths), hq, d, generator=gen).to(dtype)
    positions = [length - 1 for length in lengths]
    for invariant in (True, False):
        batched = attn.decode_attention(q, k, v, positions, scale=d**-0.5, invariant=invariant)
        for s, length in enumerate(lengths):
            alone = attn.attention(q[s:s + 1], k[s, :length], v[s, :length], q_offset=length - 1, scale=d**-0.5,
                                  invariant=invariant)
            if invariant:
                assert torch.equal(batched[s:s + 1], alone), s
            else:
                torch.testing.assert_close(batched[s:s + 1], alone, rtol=2e-2, atol=2e-2)


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
