"""How the invariant ``linear`` (``lathe.kernels.ops``) cuts its products: shapes only, no arithmetic on tensors.

Owns the reference tile height (``ROW_TILE``) and the heights a pool may add (``ROW_TILE_CANDIDATES``,
``DIRECT_TILE_CANDIDATES``), the ``Ladder`` that carries a pool's admitted heights into ``ops.linear``, the
column blocks a weight is cut into (``col_cap``, ``col_blocks``), the row groups over a ladder (``row_groups``)
and which rows count as lone (``lone_rows``, ``lone_height``). Every cut depends on the weight's shape and dtype
and the row count alone, never on the rows' values; ``lathe.models.tiles`` admits the heights per machine by bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_TILE = 16
"""Rows of the reference ``ops.linear`` tile in invariant mode (measured invariant at every position on AVX2 and
on AVX-512 with and without MKL's AVX2 path; 8 was not, under that path)."""

ROW_TILE_CANDIDATES = (1, 4, 64, 128)
"""Other tile heights a pool may add to its ladder (``Ladder.tiles``) when its self-check finds their
rows bitwise equal to the reference tile's on that machine (``lathe.models.tiles.choose_row_tiles``)."""

DIRECT_TILE_CANDIDATES = (1, 4, 8, 16, 32, 64, 128, 256)
"""Row heights a pool may run as direct products (``Ladder.direct``): one plain library product per tile,
with the library's own threads and blocking, when its self-check finds their rows bitwise equal to the reference
tile's at every thread count (``lathe.models.tiles.choose_direct_tiles``)."""


@dataclass(frozen=True, slots=True)
class Ladder:
    """How an invariant ``linear`` cuts its rows into products on one pool; the default is the reference tile
    alone, and a pool's self-check admits the rest per machine, by bits (``lathe.models.exactness``).

        tiles   heights of ``ops.tiled_matmul`` tiles, cut by ``row_groups``; ``ROW_TILE`` is one of them
        direct  heights run as ``ops.direct_matmul`` products (CPU); where any, every row runs there
        lone    how ``ops.direct_matmul`` runs the rows fewer than its smallest height (a lone decode row): in
                ``tiled_matmul`` tiles of this height (one of ``tiles``), or zero-padded to one direct tile (0)
        chain   where not 0, those rows run instead through Lathe's own fixed-order product with k-blocks of this
                size (``lathe.kernels.chain``), admitted where it gives them the reference tile's bits
        chain_rows  with ``chain``, a call of at most this many rows runs all of them through that product too (a
                decode step's batch, where the pool timed it faster than the direct tiles: it reads each weight
                once for all its rows, and a row's bits there do not depend on the others); 0: lone rows only
    """

    tiles: tuple[int, ...] = (ROW_TILE,)
    direct: tuple[int, ...] = ()
    lone: int = ROW_TILE
    chain: int = 0
    chain_rows: int = 0

    def chains(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows runs all of them through Lathe's product (``chain``): fewer rows than
        the smallest direct height (lone decode rows) or at most ``chain_rows``; never without direct heights."""
        return bool(self.chain and self.direct and (rows < min(self.direct) or rows <= self.chain_rows))


REFERENCE = Ladder()
"""The reference tile alone: what a linear runs before (or without) a self-check."""

COL_BLOCK_BYTES = 1 << 22
"""Most bytes of weight one ``ops.linear`` product reads; wider weights are cut into column blocks."""

COL_STEP = 64
"""Column blocks hold a multiple of this many columns (at least one step)."""

SPLIT_WIDTH = 256
"""Fewest columns of each half when ``col_blocks`` halves a weight narrower than its byte cap (a LoRA shrink,
at most ``MAX_RANK`` wide, is never halved)."""

SPLIT_BYTES = 1 << 20
"""Fewest bytes of a weight that ``col_blocks`` halves: a smaller one (a LoRA expand of rank 32 or less) costs a
lone tile little on one thread, and halving it would double its products and gradients in every batch."""


def col_cap(k: int, element_size: int) -> int:
    """Most columns of one block of a weight with ``k`` rows: a multiple of ``COL_STEP`` holding at most
    ``COL_BLOCK_BYTES`` (at least ``COL_STEP``)."""
    return max(COL_STEP, COL_BLOCK_BYTES // (k * element_size) // COL_STEP * COL_STEP)


def col_blocks(k: int, n: int, element_size: int) -> list[tuple[int, int]]:
    """The column blocks ``[(c0, c1), ...]`` of a ``[K, N]`` weight in invariant products; they depend on the
    weight's shape and dtype alone.

    A weight at least ``col_cap`` columns wide is cut into blocks of that width (they depend on K alone, so
    its first ``col_cap`` columns, as a weight, have its first block); a narrower one of at least
    ``SPLIT_BYTES`` into two halves of at least ``SPLIT_WIDTH`` columns (a multiple of 16) where it has them;
    else it is one block.
    """
    cap = col_cap(k, element_size)
    if n >= cap:
        width = cap
    else:
        half = -(-n // 32) * 16
        width = half if half >= SPLIT_WIDTH and k * n * element_size >= SPLIT_BYTES else n
    return [(c, min(c + width, n)) for c in range(0, n, width)]


def row_groups(rows: int, tiles: tuple[int, ...], least: int = 1) -> list[tuple[int, int, int]]:
    """How ``ops.linear`` cuts ``rows`` rows over a ladder of tile heights: ``[(start, stop, tile), ...]``.

    Largest tile first, each taking as many whole tiles as fit when they are at least ``least`` tiles (a
    group of fewer would be padded with zero tiles up to the thread count: ``ops._bmm``); the smallest tile takes
    the rest (its last tile zero-padded). Depends on the row count and ``least`` only; with one tile height
    it is one group.
    """
    ladder = sorted(set(tiles), reverse=True)
    groups, start = [], 0
    for tile in ladder[:-1]:
        stop = start + (rows - start) // tile * tile
        if stop - start >= least * tile:
            groups.append((start, stop, tile))
            start = stop
    if rows > start or not groups:
        groups.append((start, rows, ladder[-1]))
    return groups


def lone_rows(ladder: Ladder, rows: int, device: torch.device) -> bool:
    """Whether ``rows`` rows are too few for any of ``ladder``'s direct heights on ``device`` (a decode step's lone
    row on CPU): ``ops.direct_matmul`` runs them as ``ladder.lone`` and ``ladder.chain`` say."""
    return bool(ladder.direct) and device.type == "cpu" and rows < min(ladder.direct)


def lone_height(ladder: Ladder, rows: int, device: torch.device) -> int:
    """The direct tile height an invariant ``linear`` zero-pads ``rows`` rows to on ``ladder`` (``lone_rows``, with
    ``lone=0`` and no ``chain``), as ``ops.direct_matmul`` does; 0 where it runs them otherwise."""
    if ladder.lone or ladder.chain or not lone_rows(ladder, rows, device):
        return 0
    return min(ladder.direct)
