"""Grouped LoRA for the invariant CPU path: every segment of a packed batch in one shrink and one expand.

    lora_grouped(x, layout, a, b, scale) -> y
      x: [T, I]; layout: segments (s0, s1, j) of rows, each padded to whole tiles of ``layout.tile`` rows
      a[j]: [r, I], b[j]: [O, r] (one rank per call); scale[j]: float
      y[s0:s1] = ((x[s0:s1] @ a[j].T) * scale[j]) @ b[j].T   for each segment; rows in no segment: 0
                                                                             -> y: [T, O] (fp32 or wider)

Every product has the shape the per-segment reference (``LoraBatch.delta_per_segment``: ``ops.linear`` on
each segment alone) gives it: ``[tile, I] @ [I, r]`` per tile for the shrink, ``[tile, r] @ [r, <= block]``
per tile and column block for the expand, the same weight layouts (transposed views), the same column
blocks, and the scale applied to the shrink's ``[T, r]`` result (r values a row, not O), before the
expand. Each product kind is one ``ops._bmm`` over every tile where a tile's weight can be a view (the batch
has one adapter) or a stacked copy (short segments, small weights: ``stacks``), else one ``ops._bmm`` per
segment; either way a tile is the same ``[tile, .] @ [., .]`` product, so a row's bits equal the reference's.
The pool's self-check verifies that on its machine (``lathe.models.exactness``).

Backward is written out (a ``torch.autograd.Function``) so that it, too, costs a few products per target
instead of autograd's per-segment slices, zero-filled full-size gradients and concatenations. Each
segment's weight gradients are one product over its own (tile-padded) rows, segments of as many tiles batched
into one ``ops._bmm``: an adapter's gradient depends on its own rows only, never on which other adapters share
the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.kernels import ops, tiling

STACK_BYTES = 8 << 20
"""Most bytes of per-tile weight copies one grouped product makes; above it, one product per segment."""

STACK_TILES = 2
"""Most tiles a segment may have, on average, for a grouped product to stack per-tile weight copies. Measured on
a 2-core EPYC (8 segments, fp32, rank 16): stacked copies win at 1-2 tiles a segment (38 vs 246 us a shrink at
one tile, where one product per segment pads a lone tile to the threads), break even at 4, and lose at 8
(an expand to 576 columns: 2027 us stacked, 228 us per segment)."""


@dataclass(frozen=True, slots=True)
class TileLayout:
    """Where the rows of a batch's segments sit once each segment is padded to whole tiles.

    ``src [R]``: the rows of x that lie in a segment, ascending; ``dest [R]``: each one's row in the padded
    ``[tiles * tile]`` layout; ``runs``: ``(first tile, end tile, slot)`` per segment, in row order;
    ``aligned``: every row of x lies in a segment and ``dest == src`` (each segment starts on a tile boundary:
    one segment, or segments of whole tiles but the last, as a cycle of 32-token tenants packs), so padding is
    zero rows at the end and unpadding a view, with no gathers.
    """

    rows: int
    tile: int
    tiles: int
    src: torch.Tensor
    dest: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]
    aligned: bool

    @classmethod
    def build(cls, rows: int, segments: list[tuple[int, int, int]], tile: int, device: torch.device) -> TileLayout:
        """``segments``: ``(s0, s1, slot)`` with s0 < s1, ascending and disjoint, within ``rows``."""
        src, dest, runs, tiles = [], [], [], 0
        aligned = sum(s1 - s0 for s0, s1, _ in segments) == rows
        for s0, s1, slot in segments:
            n = -(-(s1 - s0) // tile)
            aligned = aligned and s0 == tiles * tile
            src.append(torch.arange(s0, s1))
            dest.append(torch.arange(tiles * tile, tiles * tile + s1 - s0))
            runs.append((tiles, tiles + n, slot))
            tiles += n
        return cls(rows, tile, tiles, torch.cat(src).to(device), torch.cat(dest).to(device), tuple(runs), aligned)

    @property
    def full(self) -> bool:
        """Whether every row of x lies in a segment (then ``src`` is ``arange(rows)``)."""
        return self.src.shape[0] == self.rows

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, W] -> [tiles, tile, W]: each segment's rows in its own tiles, the rest zero."""
        if self.aligned:
            extra = self.tiles * self.tile - self.rows
            padded = torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x
            return padded.reshape(self.tiles, self.tile, x.shape[1])
        out = x.new_zeros(self.tiles * self.tile, x.shape[1])
        out.index_copy_(0, self.dest, x if self.full else x.index_select(0, self.src))
        return out.view(self.tiles, self.tile, x.shape[1])

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """[tiles, tile, W] -> [rows, W]: the inverse of ``pad`` (rows in no segment get 0)."""
        flat = t.reshape(self.tiles * self.tile, t.shape[2])
        if self.aligned:
            return flat[: self.rows]
        picked = flat.index_select(0, self.dest)
        if self.full:
            return picked
        return picked.new_zeros(self.rows, t.shape[2]).index_copy_(0, self.src, picked)

    def per_segment_products(self, lhs: torch.Tensor, rhs: torch.Tensor) -> list[torch.Tensor]:
        """``lhs[seg].T @ rhs[seg]`` for each segment, in run order; lhs [tiles, tile, m], rhs [tiles, tile, n]
        -> [m, n] each, where ``seg`` is a segment's own tiles as one ``[tiles_s * tile, .]`` block (its padding
        rows are zero).

        A segment's rows are cut into ``parts`` equal spans (``_spans``: as many as the threads, so a segment
        alone keeps every thread busy), each span's product runs on one thread (``ops._bmm``), and the parts
        are added in order: the bits depend on the segment and the thread count, never on the other segments.
        Consecutive segments of as many tiles share one ``ops._bmm`` (their spans are views of the same tiles).
        """
        out: list[torch.Tensor] = []
        i = 0
        while i < len(self.runs):
            t0, t1, _ = self.runs[i]
            k, j = t1 - t0, i + 1
            while j < len(self.runs) and self.runs[j][1] - self.runs[j][0] == k:
                j += 1
            end, parts = t0 + (j - i) * k, _spans(k * self.tile)
            span = k * self.tile // parts
            # contiguous: a column block of a wider gradient gets one layout however many segments share it
            left = lhs[t0:end].contiguous().view(-1, span, lhs.shape[2])
            prods = ops._bmm(left.transpose(1, 2), rhs[t0:end].reshape(-1, span, rhs.shape[2]))
            prods = prods.view(j - i, parts, *prods.shape[1:])
            total = prods[:, 0]
            for p in range(1, parts):
                total = total + prods[:, p]
            out += total.unbind(0)
            i = j
        return out


def _spans(rows: int) -> int:
    """Spans a segment of ``rows`` rows is cut into for its weight-gradient products: the most, up to the
    thread count, that divide it evenly."""
    return max(p for p in range(1, max(torch.get_num_threads(), 1) + 1) if rows % p == 0)


def stacks(layout: TileLayout, weight: torch.Tensor) -> bool:
    """Whether a grouped product over ``layout`` stacks per-tile copies of weights shaped like ``weight`` (one
    product for all its segments) rather than running one product per segment (segments of more than
    ``STACK_TILES`` tiles on average, or copies past ``STACK_BYTES``)."""
    return (layout.tiles <= STACK_TILES * len(layout.runs)
            and layout.tiles * weight.numel() * weight.element_size() <= STACK_BYTES)


def _products(lhs: torch.Tensor, mats: list[torch.Tensor], layout: TileLayout, transpose: bool) -> torch.Tensor:
    """``lhs[t] @ op(mats[slot of tile t])`` for every tile; op is ``.T`` when ``transpose``; lhs [tiles, m, k].

    The weight operand keeps the layout the reference reads (a transposed view when ``transpose``): a
    view expanded over the tiles when every run has one slot, stacked copies when small, else one product
    per run, written into its rows of the result.
    """
    def op(m: torch.Tensor) -> torch.Tensor:
        return m.t() if transpose else m

    slots = {slot for _, _, slot in layout.runs}
    tiles = layout.tiles
    if len(slots) == 1:
        w = op(mats[slots.pop()])
        return ops._bmm(lhs, w.expand(tiles, *w.shape))
    if stacks(layout, mats[0]):
        stacked = torch.stack([mats[slot] for t0, t1, slot in layout.runs for _ in range(t1 - t0)])
        return ops._bmm(lhs, stacked.transpose(1, 2) if transpose else stacked)
    out = lhs.new_empty(tiles, lhs.shape[1], op(mats[0]).shape[1])
    for t0, t1, slot in layout.runs:  # each run's products written in place: no [tiles, m, n] concatenation
        w = op(mats[slot])
        ops._bmm(lhs[t0:t1], w.expand(t1 - t0, *w.shape), out=out[t0:t1])
    return out


def _columns(mats: list[torch.Tensor], c0: int, c1: int) -> list[torch.Tensor]:
    """Rows ``c0:c1`` of each expand weight (a column block of its output); the weights themselves when the block
    is all of them (one op fewer per adapter and target)."""
    return mats if c0 == 0 and c1 == mats[0].shape[0] else [m[c0:c1] for m in mats]


class _GroupedLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: TileLayout, scales: list[float], n: int,  # noqa: ANN001
                *weights: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        a, b = [m.to(wide) for m in weights[:n]], [m.to(wide) for m in weights[n:]]
        xt = layout.pad(x.to(wide))
        scale = torch.tensor([scales[slot] for t0, t1, slot in layout.runs for _ in range(t1 - t0)], dtype=wide,
                             device=x.device).view(-1, 1, 1)
        vs = _products(xt, a, layout, transpose=True).mul_(scale)  # [tiles, tile, r]: the scaled shrink
        rank, out_features = a[0].shape[0], b[0].shape[0]
        blocks = tiling.col_blocks(rank, out_features, b[0].element_size())
        parts = [_products(vs, _columns(b, c0, c1), layout, transpose=True) for c0, c1 in blocks]
        yt = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        ctx.save_for_backward(x, vs, scale, *a, *b)  # x, not its padded wide copy: backward rebuilds that
        ctx.layout, ctx.n, ctx.blocks, ctx.x_dtype = layout, n, blocks, x.dtype
        ctx.w_dtypes = [m.dtype for m in weights]
        return layout.unpad(yt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        x, vs, scale, *weights = ctx.saved_tensors
        layout, n = ctx.layout, ctx.n
        a, b = weights[:n], weights[n:]
        gt = layout.pad(grad.to(vs.dtype))  # [tiles, tile, O]
        dvs = None
        grad_b: list[list[torch.Tensor]] = []
        for c0, c1 in ctx.blocks:
            g = gt[:, :, c0:c1]
            part = _products(g, _columns(b, c0, c1), layout, transpose=False)  # [tiles, tile, r]
            dvs = part if dvs is None else dvs + part
            grad_b.append(layout.per_segment_products(g, vs))  # [blk, r] per segment
        dv = dvs.mul_(scale)
        dx = _products(dv, list(a), layout, transpose=False)  # [tiles, tile, I]
        grad_a = layout.per_segment_products(dv, layout.pad(x.to(vs.dtype)))  # [r, I] per segment
        da: list[torch.Tensor | None] = [None] * n
        db: list[torch.Tensor | None] = [None] * n
        for s, (_, _, slot) in enumerate(layout.runs):
            block_grads = [g[s] for g in grad_b]
            gb = block_grads[0] if len(block_grads) == 1 else torch.cat(block_grads)
            da[slot] = grad_a[s] if da[slot] is None else da[slot] + grad_a[s]
            db[slot] = gb if db[slot] is None else db[slot] + gb
        dx_rows = layout.unpad(dx).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grads = [g if g is None or g.dtype == dt else g.to(dt) for g, dt in zip(da + db, ctx.w_dtypes, strict=True)]
        return (dx_rows, None, None, None, *grads)


def lora_grouped(x: torch.Tensor, layout: TileLayout, a: list[torch.Tensor], b: list[torch.Tensor],
                 scales: list[float]) -> torch.Tensor:
    """See the module docstring. ``a``, ``b`` and ``scales`` are indexed by the layout's slots."""
    return _GroupedLora.apply(x, layout, scales, len(a), *a, *b)
