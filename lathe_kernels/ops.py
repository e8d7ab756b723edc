"""The ops Lathe's decoder calls, in a batch-invariant mode and a plain torch mode.

Trainer and sampler run the same decoder through these ops. With ``invariant=True`` a row's (a
token's) result has the same bits whatever the batch: how many rows there are, what the other rows
hold, padding, and whether the token is computed in a prefill or decoded alone against a KV cache.
That is what makes the logprob the sampler reports bitwise equal to the one the trainer computes
(docs/exactness.md). With ``invariant=False`` each op is the plain, fastest torch call; values agree
with the invariant mode to rounding, bits do not. The mode is an argument, never global state.

    linear(x, weight, bias) -> y
      x: [..., K]; weight: [N, K]; bias: [N] or None
      y = x @ weight.T + bias                                               -> y: [..., N]

    rms_norm(x, weight, eps) -> y                      (Llama RMSNorm, statistics in fp32 or wider)
      x: [..., D]; weight: [D]
      y = weight * (x / sqrt(mean(x ** 2, -1) + eps)).to(x.dtype)           -> y: [..., D]

    log_softmax(x, dim) -> y
      y = x - logsumexp(x, dim), computed and returned in fp32 or wider     -> y: x.shape

How the invariant mode gets its bits. A kernel library (MKL, oneDNN, cuBLAS) picks its code path by
shape and by the CPU's instruction set: on one AVX-512 CPU every row of an fp32 matmul changes bits once
M reaches 16 rows; under MKL's AVX2 path a row's position inside an 8-row block changes them. Padding
to "a multiple of 4" was tuned to where one CPU switched. So the invariant mode never lets a batch
choose a shape: every matmul is cut into tiles of fixed shape and the tiles go through ONE batched
matmul (``torch.bmm`` with the shared operand expanded, never copied, padded with zero products to at
least as many products as threads, so that each product runs on one thread), so the library sees the same
problem whatever the batch and the thread count, and a row's bits depend only on its own values:
- ``linear``: rows in tiles of ``ROW_TILE`` (zero-padded), the weight's columns in blocks (``col_blocks``:
  at most ``COL_BLOCK_BYTES``, so a block stays in cache while every tile reads it, and a weight of 1-4 MiB in
  two halves, so a lone tile's two products keep two threads busy; the blocks depend only on
  the weight, never on the batch): each product is ``[ROW_TILE, K] @ [K, <= block]``. A pool may pass a
  ladder of tile heights (``Ladder.tiles``): rows are then cut largest tile first (``row_groups``), which keeps a
  row's bits only because the pool's self-check admitted each height to the ladder after finding its rows
  bitwise equal to the ``ROW_TILE`` tile's on that machine (larger tiles re-pack each weight block less
  often; a 1-row tile is a GEMV).
- ``linear``'s direct products: where a library computes each row of a product from that row alone, at every
  height and thread count (the AVX-512 EPYC this was written on does: fp32 from 4 rows, bf16 from 1 for most
  shapes), the one-thread products and their padding buy nothing. A pool then runs its linears as
  ``direct_matmul``: rows cut into tiles of a few fixed heights (``DIRECT_TILE_CANDIDATES``), each tile one
  plain product with the library's own threads and blocking. The library still sees a fixed set of shapes,
  and the self-check admits each height only where its rows have the ``ROW_TILE`` tile's bits
  (``choose_direct_tiles``); where none is admitted, the tiles above run as they did. Rows fewer than the
  smallest height (a lone decode row) run where the pool found them fastest among the bit-admitted ways
  (``Ladder.lone``): zero-padded to a direct tile, or in a tile of the ladder, or, where the library's tiles
  compute each element in one fixed order that Lathe's own product repeats, through that (``Ladder.chain``,
  ``lathe.kernels.chain``), which reads each weight once and pads nothing.
- ``attention``, ``attention_batch`` and ``decode_attention`` live in ``lathe.kernels.attention``: fixed key
  chunks and fixed row tiles, in the same way.
- ``log_softmax`` over the last dim is row-invariant in plain torch (its kernel splits the work over
  rows only), so both modes share the code. ``rms_norm`` is too, except that torch splits the mean of
  a lone row across threads once it has more than ``LONE_ROW_SPLIT`` elements; the invariant mode gives a lone row
  a zero partner row.
Backward passes go through torch autograd in both modes (only the forward is batch-invariant).

The tile sizes are the measured part: ``lathe.models.exactness.self_check`` runs every op at the pool's
own shapes, rows alone vs in batches of awkward sizes and at every position of a tile, prefill vs
decode, at each thread count, when a pool starts, and reports the first op that is not invariant on
that machine. ``bench/bench_invariance.py`` measures the cost against the plain ops. The shapes
(tile heights, the ``Ladder``, column blocks, row groups) are ``lathe.kernels.tiling``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lathe.kernels.activations import recomputed
from lathe.kernels.chain import chain_matmul
from lathe.kernels.tiling import REFERENCE, ROW_TILE, Ladder, col_blocks, col_cap, row_groups


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are kept in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended along dim -2 so that its size is a positive multiple of ``multiple``."""
    rows = x.shape[-2]
    target = max(multiple, -(-rows // multiple) * multiple)
    return x if target == rows else F.pad(x, (0, 0, 0, target - rows))


def _pad_batch(x: torch.Tensor, want: int) -> torch.Tensor:
    """x [n, M, K] with zero matrices appended up to ``want``, in x's own layout: a transposed view ([n, K, M] in
    memory) stays one, so the library reads a padded batch the way it reads the same batch unpadded."""
    if x.stride(-2) == 1 and x.stride(-1) != 1:
        return _pad_batch(x.transpose(1, 2), want).transpose(1, 2)
    return F.pad(x, (0, 0, 0, 0, 0, want - x.shape[0]))


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """c[i] = a[i] @ b[i] for a [B, M, K], b [B, K, N] -> c [B, M, N], every product run by one thread; written
    into ``out`` (a contiguous [B, M, N]) when given.

    On CPU the batch is padded with zero products up to torch's thread count. MKL runs a batch of at
    least as many products as threads one product per thread, but splits a product across threads when
    there are fewer (measured on AVX-512 Xeons, and under MKL's AVX2 path: a lone [16, 1536] @ [1536, 32]
    product, or two products at 4 threads, get other bits than the same products in a larger batch). With
    the padding a product's bits depend on its own shape alone, never on the batch count or the threads.
    On CUDA it is the batch-invariant Triton kernel (cuBLAS picks algorithms by batch count).
    """
    if a.is_cuda:
        from lathe.kernels.invariant_triton import invariant_bmm

        c = invariant_bmm(a, b)
    else:
        n, want = a.shape[0], torch.get_num_threads()
        if n == 0 or n >= want:
            return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
        a = _pad_batch(a, want)
        shared = b.shape[0] == 1 or b.stride(0) == 0  # one operand for every product: still a view
        b = b[:1].expand(want, *b.shape[1:]) if shared else _pad_batch(b, want)
        c = torch.bmm(a, b)[:n]
    return c if out is None else out.copy_(c)


def tiled_matmul(x: torch.Tensor, w: torch.Tensor, *, tile: int = ROW_TILE) -> torch.Tensor:
    """y = x @ w with every product of one fixed shape; x [M, K], w [K, N] -> y [M, N].

    x's rows are zero-padded to whole tiles of ``tile`` rows and w's columns cut into ``col_blocks``; per
    block, one ``bmm`` over all tiles with w's block expanded (a view): each product is
    ``[tile, K] @ [K, block]``, so row i's bits depend on row i alone. A lone tile runs the same products
    in one ``bmm`` over the blocks instead (``_lone_tile``).
    """
    if x.is_cuda:  # the Triton kernel is invariant over any row count: no tiles needed
        return _bmm(x[None], w[None])[0]
    m, k = x.shape
    n = w.shape[1]
    tiles = _pad_rows(x, tile).view(-1, tile, k)
    count = tiles.shape[0]
    blocks = col_blocks(k, n, w.element_size())
    if count == 1 and len(blocks) > 1:
        return _lone_tile(tiles[0], w, blocks)[:m]
    parts = [_bmm(tiles, w[:, c0:c1].expand(count, k, c1 - c0)) for c0, c1 in blocks]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.view(count * tile, n)[:m]


def _lone_tile(t: torch.Tensor, w: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """t [tile, K] @ w [K, N] -> [tile, N] as ``tiled_matmul``'s products for one tile: the same
    ``[tile, K] @ [K, block]`` products with the same operand layouts, but the blocks of equal width in ONE
    ``bmm`` (the tile expanded over them, the blocks a view of w), a product per thread, where a ``bmm`` per
    block would run each product on one thread beside zero padding."""
    tile, k = t.shape
    width = blocks[0][1] - blocks[0][0]
    even = sum(c1 - c0 == width for c0, c1 in blocks)
    y = _bmm(t.expand(even, tile, k), w[:, : even * width].unflatten(1, (even, width)).permute(1, 0, 2))
    y = y.permute(1, 0, 2).reshape(tile, even * width)
    if even == len(blocks):
        return y
    c0 = even * width  # the narrower last block
    return torch.cat([y, _bmm(t[None], w[None, :, c0:])[0]], dim=1)


def direct_matmul(x: torch.Tensor, w: torch.Tensor, heights: tuple[int, ...], lone: int = ROW_TILE,
                  packed: torch.Tensor | None = None, chain: int = 0) -> torch.Tensor:
    """y = x @ w as direct products; x [M, K], w [K, N] -> y [M, N].

    Rows are cut largest height first (each height taking as many whole tiles as fit) and each tile is one
    plain ``[h, K] @ [K, <= col_cap]`` product per column block of ``col_cap`` width (the library threads
    it as it likes), written in place. Rows left over, fewer than the smallest height (a lone decode row), run
    as ``tiled_matmul`` with tiles of ``lone`` rows, or, with ``lone=0``, zero-padded to one direct tile of the
    smallest height. A row's bits are the reference tile's only on a machine where the pool's self-check
    admitted ``heights`` (``choose_direct_tiles``, whose trial runs this function with ``lone=0``) and ``lone``
    (a height of its tile ladder). With ``packed`` (``prepack(w.T, smallest height)``), a zero-padded lone tile is
    multiplied by that copy instead of ``w`` (``prepacked_tile``; the pool admits it by bits: ``choose_packed``).
    With ``chain`` (``Ladder.chain``), those rows run through ``lathe.kernels.chain`` instead of any tile (a call
    whose rows run there all together is the caller's to route: ``Ladder.chains``).
    """
    x = x.contiguous()  # the rows' layout the self-check admitted the heights with
    m = x.shape[0]
    n = w.shape[1]

    def product(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return direct_tile(rows, w, out)

    smallest = min(heights, default=0)

    def padded(rows: torch.Tensor) -> torch.Tensor:  # fewer than ``smallest``: one zero-padded tile, sliced back
        tile = F.pad(rows, (0, 0, 0, smallest - rows.shape[0]))
        y = product(tile, x.new_empty(smallest, n)) if packed is None else prepacked_tile(tile, packed)
        return y[:rows.shape[0]]

    if chain and m < smallest:
        return chain_matmul(x, w, chain)
    if m < smallest and not lone:  # a decode step's lone row: its product is a view of the padded tile's
        return padded(x)
    y = x.new_empty(m, n)
    start = 0
    for h in sorted(heights, reverse=True):
        stop = start + (m - start) // h * h
        for s in range(start, stop, h):
            product(x[s:s + h], y[s:s + h])
        start = stop
    if start < m and smallest and chain:
        y[start:] = chain_matmul(x[start:], w, chain)
    elif start < m and smallest and not lone:
        y[start:] = padded(x[start:])
    elif start < m:
        y[start:] = tiled_matmul(x[start:], w, tile=lone or ROW_TILE)
    return y


def prepack(weight: torch.Tensor, height: int) -> torch.Tensor | None:
    """``weight`` [N, K] packed once by oneDNN for products of ``height`` rows (``prepacked_tile``), or None where
    this torch build has no such packing, or not for this dtype on this CPU (oneDNN packs bf16 only where the CPU has
    AVX-512 or AVX-NE-CONVERT: an AVX2 machine refuses), or ``weight`` is wider than one column block
    (``direct_tile`` cuts those, and the packed product would not). CPU only."""
    n, k = weight.shape
    if weight.device.type != "cpu" or n > col_cap(k, weight.element_size()) \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, height)
    except RuntimeError:
        return None


def prepacked_tile(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows [h, K] @ the weight ``packed`` holds (``prepack``) -> [h, N]: one oneDNN product on a weight packed
    once, where ``direct_tile`` packs it again for every product. Its rows have ``direct_tile``'s bits only where
    a pool's trial found so (``lathe.models.tiles.choose_packed``)."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, None, "none", [], "")


def direct_tile(rows: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [h, K] @ w [K, N] -> [h, N] as ``direct_matmul`` runs one tile of an admitted height: one plain product
    per column block of ``col_cap`` width, written into ``out`` when given."""
    n, cap = w.shape[1], col_cap(w.shape[0], w.element_size())
    if n <= cap:
        return torch.mm(rows, w, out=out)
    out = rows.new_empty(rows.shape[0], n) if out is None else out
    for c0 in range(0, n, cap):
        out[:, c0:c0 + cap] = rows @ w[:, c0:c0 + cap]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, invariant: bool,
           ladder: Ladder = REFERENCE, grad_ladder: Ladder = REFERENCE, packed: torch.Tensor | None = None
           ) -> torch.Tensor:
    """y = x @ weight.T + bias; x [..., K], weight [N, K], bias [N] or None -> y [..., N].

    Invariant mode flattens the leading dims to M rows. With ``ladder.direct`` heights (CPU), rows run as
    ``direct_matmul`` (rows fewer than its smallest height as ``ladder.lone`` says); otherwise they are cut
    into ``row_groups(M, ladder.tiles)`` and ``tiled_matmul`` runs each group with its tile height. The bias is
    added after. Mixing heights keeps a row's bits only where every height gives the reference tile's bits: the
    self-check picks the ladder per machine and verifies that. Differentiable in both modes: in invariant mode
    backward's dX = dY @ weight runs over its own ladder, ``grad_ladder``, admitted by bits on the transposed
    products (``_InvariantLinear``). ``packed``: ``weight``'s prepacked copy (``prepack``), which a lone row runs
    through out of autograd where the pool admitted that way (``direct_matmul``).
    """
    if not invariant:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _InvariantLinear.apply(rows, weight, ladder, grad_ladder)
    else:
        y = _tiled_linear(rows, weight, ladder, packed)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def chained_block(x: torch.Tensor, weight: torch.Tensor, *, invariant: bool, ladder: Ladder) -> int:
    """The k-block with which ``linear(x, weight, invariant=, ladder=)`` (no bias) runs ``x``'s rows through Lathe's
    kernel (``lathe.kernels.chain``: fp32 rows on the CPU out of autograd, fewer than the smallest direct height or
    at most ``ladder.chain_rows``: ``Ladder.chains``), else 0. A caller that runs those rows with
    more in the same call (``chain.chain_linear``) asks here first, so that both ways give the rows the same bits."""
    if not invariant or x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.float32 \
            or not ladder.chains(x.shape[0]):
        return 0
    return 0 if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) else ladder.chain


def _tiled_linear(rows: torch.Tensor, weight: torch.Tensor, ladder: Ladder, packed: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """rows [M, K] @ weight.T as ``direct_matmul`` over ``ladder.direct`` (CPU), else over
    ``row_groups(M, ladder.tiles)`` -> [M, N]."""
    w = weight.t()
    if ladder.direct and rows.device.type == "cpu":
        if ladder.chains(rows.shape[0]):  # every row through Lathe's kernel, in the layout the tiles would read
            return chain_matmul(rows.contiguous(), w, ladder.chain)
        return direct_matmul(rows, w, ladder.direct, ladder.lone, packed, ladder.chain)
    least = torch.get_num_threads() if rows.device.type == "cpu" else 1
    groups = row_groups(rows.shape[0], ladder.tiles, least)
    parts = [tiled_matmul(rows[a:b], w, tile=tile) for a, b, tile in groups]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _InvariantLinear(torch.autograd.Function):
    """``_tiled_linear`` under autograd. The forward's ladder gives a row the reference tile's bits, but the
    same heights in backward need not share bits: a row's dX would depend on the tile height its batch's size
    chose (measured on an AVX-512 Xeon: a tenant's gradient changed with its batch mates). So backward runs
    dX = dY @ weight over ``grad_ladder``, whose heights the pool admits by bits on the transposed products (the
    reference tile alone unless a pool chose more); and only x and the weight are saved, not the forward's
    padded tiles."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, ladder: Ladder,  # noqa: ANN001
                grad_ladder: Ladder) -> torch.Tensor:
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, weight)  # x only for a trained weight
        ctx.grad_ladder = grad_ladder
        return _tiled_linear(rows, weight, ladder)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        rows, weight = ctx.saved_tensors
        dx = _tiled_linear(grad, weight.t(), ctx.grad_ladder) if ctx.needs_input_grad[0] else None
        dw = grad.t() @ rows if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


LONE_ROW_SPLIT = 32768
"""Longest lone row torch reduces in one pass; the mean of a longer one is split across threads (measured, torch
2.x on CPU), so the invariant ``rms_norm`` gives such a row a zero partner, as it would have in a batch."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, invariant: bool) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x ** 2, -1) + eps)).to(x.dtype); x [..., D], weight [D] -> [..., D].

    The statistic is computed in fp32 (fp64 for fp64 input), as Llama-family models do. Row-invariant
    in both modes except for a lone row of more than ``LONE_ROW_SPLIT`` elements, which only the invariant mode
    handles (it reduces the row next to a zero row, as it would be in any batch).
    """
    wide = _wide(x.dtype)
    if x.dtype == wide:  # no upcast and no cast back (a decode step makes two calls a layer: their cost counts)
        return weight * (x * torch.rsqrt(_mean_square(x, invariant) + eps))
    xf = x.to(wide)
    # a narrower x: backward reads its upcast again rather than autograd keeping the wide copy
    with recomputed(xf, lambda: x.to(wide)):
        return weight * (xf * torch.rsqrt(_mean_square(xf, invariant) + eps)).to(x.dtype)


def _mean_square(xf: torch.Tensor, invariant: bool) -> torch.Tensor:
    """mean(xf ** 2, -1, keepdim=True) of ``rms_norm``'s widened rows; a lone invariant row longer than
    ``LONE_ROW_SPLIT`` reduced beside a zero row."""
    if invariant and xf.shape[-1] > LONE_ROW_SPLIT and xf.numel() == xf.shape[-1]:
        paired = _pad_rows(xf.reshape(1, -1), 2)
        return paired.pow(2).mean(-1, keepdim=True)[:1].reshape(*xf.shape[:-1], 1)
    return xf.pow(2).mean(-1, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1, *, invariant: bool) -> torch.Tensor:
    """y = x - logsumexp(x, dim), in fp32 (fp64 for fp64 input) -> y: x.shape.

    Plain ``torch.log_softmax`` over the last dim is already row-invariant (measured for 1-256 rows
    of up to 100000 entries, 1 and 2 threads), so both modes run the same code; ``invariant`` is
    accepted so that every op of the decoder takes the same switch.
    """
    return torch.log_softmax(x.to(_wide(x.dtype)), dim)
