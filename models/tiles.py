"""Choosing the tiles of a pool's batch-invariant linears on this machine: values handed to the decoder
(``Decoder.ladder``, ``grad_ladder``, ``lora_ladders``, ``panels``, ``packed``) that ``lathe.models.exactness`` checks.

Per machine, because batch invariance is a property of the kernel library's code paths (``lathe.kernels.ops``).
``choose_ladder`` admits direct heights (``tiling.DIRECT_TILE_CANDIDATES``) and tile heights (``tiling.ROW_TILE``
and ``tiling.ROW_TILE_CANDIDATES``) only where their rows are bitwise the reference tile's for every base weight and
the LM head (whole batch, shifted batch, lone rows) at every thread count; ``choose_lone`` keeps the fastest way of
running a lone decode row among those that hold those bits on many lone rows (``trials.lone_row_failure``): the one
choice made by time, as it cannot change a bit. Attention's choices are ``lathe.models.attention_tiles``'; the
trials themselves (row counts, comparison, lone-row trial) ``lathe.models.trials``', which the self-check runs too.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch

from lathe.kernels import chain, ops, tiling
from lathe.models.attention_tiles import choose_attention_chain, choose_attention_tiles
from lathe.models.decoder import Decoder, layer_weight_names, shape_weight_names
from lathe.models.lora import UNEMBED, module_shape, shape_keys
from lathe.models.trials import (
    BATCH_ROWS,
    at_threads,
    differing,
    lone_row_failure,
    trial_rows,
)


def default_threads(model: Decoder) -> list[int]:
    """The thread counts a pool checks: 1 and torch's current count on CPU, the current count elsewhere."""
    if model.device.type == "cpu":
        return sorted({1, torch.get_num_threads()})
    return [torch.get_num_threads()]


def head_block(head: torch.Tensor) -> torch.Tensor:
    """The LM head's ``[V, K]`` weight cut to its first column block of products (its first ``tiling.col_cap`` rows,
    or all of a head narrower than that): a slice whose products have the whole head's shapes, which
    ``choose_row_tiles`` tries instead of the whole vocabulary."""
    return head[:tiling.col_cap(head.shape[1], head.element_size())]


def model_weights(model: Decoder) -> list[torch.Tensor]:
    """One ``[N, K]`` base weight per distinct layer shape (``shape_weight_names``), and the LM head's
    ``head_block`` (the self-check then runs the whole head with the chosen ladder)."""
    shapes: dict[tuple[int, int], torch.Tensor] = {}
    for name in shape_weight_names(model.cfg):
        weight = model.w[name]
        shapes.setdefault(tuple(weight.shape), weight)
    return [*shapes.values(), head_block(model.lm_head)]


def backward_weights(model: Decoder) -> list[torch.Tensor]:
    """The operands of the linears' backward products, dX = dY @ W, as ``[K, N]`` weights (what
    ``choose_row_tiles`` takes): each distinct layer shape, and the whole LM head (its backward reduces over
    the vocabulary, so a slice would not have its shapes)."""
    layers = model_weights(model)[:-1]
    return [w.t() for w in (*layers, model.lm_head)]


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _RowTrial:
    """Row pools for ``weights`` and their reference tile's products at each thread count, computed once; ``agrees``
    tries a way of computing the products against them."""

    def __init__(self, weights: list[torch.Tensor], threads: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.weights, self.threads = [w.t() for w in weights], threads
        self.pools = [torch.randn(max(BATCH_ROWS[-1], trial_rows(w.shape[1], w.dtype)), w.shape[0], generator=gen
                                  ).to(w.dtype) for w in self.weights]
        self.refs: dict[int, list[torch.Tensor]] = {}
        for n in threads:
            with at_threads(n), torch.no_grad():
                pairs = zip(self.weights, self.pools, strict=True)
                self.refs[n] = [ops.tiled_matmul(p, w, tile=tiling.ROW_TILE) for w, p in pairs]

    def agrees(self, product: Product) -> bool:
        """Whether ``product(x, w)`` gives every row the reference tile's bits, for every weight at every thread
        count: the whole pool, the pool shifted by one row (every row at the next position of its tile) and two
        lone rows. A pool has ``trial_rows`` rows, at least ``BATCH_ROWS[-1]``."""
        for n in self.threads:
            with at_threads(n):
                for w, pool, ref in zip(self.weights, self.pools, self.refs[n], strict=True):
                    cuts = ((0, pool.shape[0]), (1, pool.shape[0]), (0, 1), (1, 2))
                    if any(differing(product(pool[a:b], w), ref[a:b]) for a, b in cuts):
                        return False
        return True


def choose_row_tiles(weights: list[torch.Tensor], threads: list[int], seed: int = 0) -> tuple[int, ...]:
    """The tile ladder for ``linear`` on this machine: ``tiling.ROW_TILE`` and every ``tiling.ROW_TILE_CANDIDATES``
    height whose rows are bitwise the reference tile's for each ``[N, K]`` weight at each thread count.

    Decided by bits, not by timing, so the same machine and library always choose the same ladder. Off
    the CPU the products do not use row tiles, so the ladder is the reference tile alone.
    """
    if any(w.device.type != "cpu" for w in weights):
        return (tiling.ROW_TILE,)
    return _tile_ladder(_RowTrial(weights, threads, seed))


def _tile_ladder(trial: _RowTrial, below: int | None = None) -> tuple[int, ...]:
    """The reference tile and each admitted candidate height (only those under ``below`` when given)."""
    candidates = [t for t in tiling.ROW_TILE_CANDIDATES if below is None or t < below]
    with torch.no_grad():
        chosen = [t for t in candidates if trial.agrees(lambda x, w, t=t: ops.tiled_matmul(x, w, tile=t))]
    return tuple(sorted({tiling.ROW_TILE, *chosen}))


def choose_direct_tiles(weights: list[torch.Tensor], threads: list[int], seed: int = 0) -> tuple[int, ...]:
    """The heights of ``tiling.DIRECT_TILE_CANDIDATES`` whose direct products (``ops.direct_matmul``: one plain
    library product per tile, its own threads) give every row the reference tile's bits for each ``[N, K]``
    weight at each thread count; empty off the CPU.

    Where a kernel library computes a row from that row alone whatever the height (measured on an AVX-512 EPYC:
    fp32 from 4 rows, bf16 from 1 for most shapes), a pool then runs its linears as the library's own products
    instead of one-thread products padded to 16-row tiles. Decided by bits, like ``choose_row_tiles``.
    """
    if any(w.device.type != "cpu" for w in weights):
        return ()
    return _direct_heights(_RowTrial(weights, threads, seed))


def _direct_heights(trial: _RowTrial) -> tuple[int, ...]:
    # lone=0: the rows a height leaves over (the trial's lone rows among them) are zero-padded to a tile of it,
    # so an admitted height admits that way of running them too (``choose_lone``)
    with torch.no_grad():
        return tuple(h for h in tiling.DIRECT_TILE_CANDIDATES
                     if trial.agrees(lambda x, w, h=h: ops.direct_matmul(x, w, (h,), lone=0)))


CHAIN_ROWS = 8
"""Rows of each weight's row pool that ``choose_chain`` runs through a candidate block (a wrong block changes most
elements of every row; the self-check then runs the chosen ladder's lone rows against batches)."""


def choose_chain(trial: _RowTrial) -> int:
    """The first k-block of ``chain.BLOCKS`` whose fixed-order product (``lathe.kernels.chain``) gives the first
    ``CHAIN_ROWS`` rows of every weight's pool the reference tile's bits at every thread count, or 0: where none
    does, where a weight is not fp32, or where the kernel cannot be built here. Decided by bits."""
    if any(w.dtype != torch.float32 for w in trial.weights) or not chain.available():
        return 0
    def agrees(block: int, n: int) -> bool:
        with at_threads(n):
            return all(not differing(chain.chain_matmul(pool[:CHAIN_ROWS], w, block), ref[:CHAIN_ROWS])
                       for w, pool, ref in zip(trial.weights, trial.pools, trial.refs[n], strict=True))

    with torch.no_grad():
        return next((block for block in chain.BLOCKS if all(agrees(block, n) for n in trial.threads)), 0)


def choose_ladder(weights: list[torch.Tensor], threads: list[int], *, tiles_too: bool = False) -> tiling.Ladder:
    """The ``tiling.Ladder`` of ``weights``: ``choose_direct_tiles``, and ``choose_row_tiles`` where no direct height
    was admitted. With one, the tile ladder serves only the rows fewer than its smallest height, as a way for
    ``choose_lone`` to time: where ``tiles_too`` asks for it, only heights under the reference tile are tried (a
    taller tile is never the faster way to run a lone row); and so may Lathe's own product (``choose_chain``).
    ``lone`` is the reference tile. One trial (row pools and reference products) serves every choice."""
    if any(w.device.type != "cpu" for w in weights):
        return tiling.REFERENCE
    trial = _RowTrial(weights, threads, seed=0)
    direct = _direct_heights(trial)
    if not direct:
        return tiling.Ladder(_tile_ladder(trial), direct)
    return tiling.Ladder(_tile_ladder(trial, below=tiling.ROW_TILE) if tiles_too else (tiling.ROW_TILE,), direct,
                      chain=choose_chain(trial))


def choose_lora_ladder(model: Decoder, rank: int, threads: list[int]) -> tiling.Ladder:
    """The ladder of ``model``'s LoRA products at ``rank`` (what ``LoraBatch.delta_per_segment`` runs a decode
    step of one adapter over): ``choose_ladder`` on a shrink ``[rank, I]`` and an expand ``[O, rank]`` of every
    target width, in the dtype LoRA computes in, the LM head's expand cut to its first column block as for the
    base. A lone row is zero-padded to a direct tile (``lone=0``) where a height is admitted: a LoRA product is
    so small that the way with the fewest ops is the faster one, so it is not timed.

    Random weights stand for the adapters' (the bits depend on the shapes and the library's code paths, which
    the weights' values do not choose; so one process chooses once per set of shapes); the rank's self-check
    (``_lora_checks``) then runs the ladder."""
    cfg = model.cfg
    targets = [t for _, t in shape_keys(cfg)]
    ins = tuple(sorted({module_shape(cfg, t)[0] for t in targets}))
    outs = tuple(sorted({module_shape(cfg, t)[1] for t in targets}))
    return _lora_ladder(ins, outs, rank, torch.promote_types(model.dtype, torch.float32), model.device.type,
                        tuple(threads))


@functools.cache
def _lora_ladder(ins: tuple[int, ...], outs: tuple[int, ...], rank: int, wide: torch.dtype, device: str,
                 threads: tuple[int, ...]) -> tiling.Ladder:
    gen = torch.Generator().manual_seed(rank)
    shrinks = [torch.randn(rank, i, generator=gen) for i in ins]
    expands = [torch.randn(min(o, tiling.col_cap(rank, wide.itemsize)), rank, generator=gen) for o in outs]
    ladder = choose_ladder([w.to(device=device, dtype=wide) for w in shrinks + expands], list(threads))
    return dataclasses.replace(ladder, lone=0) if ladder.direct else ladder


def choose_lone(model: Decoder, ladder: tiling.Ladder, threads: list[int], repeats: int = 3) -> tiling.Ladder:
    """``ladder`` with the faster way to run a lone row through every linear of ``model`` (a decode step of one
    sequence): zero-padded to a direct tile of the smallest height (``lone=0``), or in the smallest tile of the
    ladder, or through Lathe's own product where ``choose_chain`` admitted a block. Each way is first held to the
    reference tile's bits on many lone rows (``lone_row_failure``), fastest first, and the first that keeps them is
    chosen: the choice among them changes speed, never bits, and is not part of the fingerprint (``UNPRINTED``).
    Where none keeps them, a lone row runs in the reference tile.

    Why timed: which is faster depends on the library. Measured on an AVX-512 EPYC, MKL runs a 4-row fp32
    product on one thread (the tiled way spreads a weight's column halves over two) while its bf16 products
    of a few rows use both threads and tiled bf16 products have no fast kernel.
    """
    if not ladder.direct:
        return ladder
    ways = [dataclasses.replace(ladder, lone=lone, chain=0) for lone in (0, min(ladder.tiles))]
    if ladder.chain:
        ways.append(ladder)
    ways.sort(key=lambda way: _pass_seconds(model, way, {}, repeats))
    return next((way for way in ways if lone_row_failure(model, way, threads) is None),
                dataclasses.replace(ladder, tiles=(tiling.ROW_TILE,), lone=tiling.ROW_TILE, chain=0))




CHAIN_ROW_CANDIDATES = (8, 16, 32, 64, 128)
"""Row counts at which ``choose_decode_rows`` times Lathe's product against the direct tiles, in this order."""


def choose_decode_rows(model: Decoder, ladder: tiling.Ladder, threads: list[int], repeats: int = 2
                       ) -> tuple[tiling.Ladder, dict[str, torch.Tensor]]:
    """How a sampling pool's decode steps run their rows where ``ladder`` admitted Lathe's product (``chain``): the
    weights as the kernel's panels (``chain.pack_panels``, by module name, the LM head as ``lora.UNEMBED``) where
    the kernel has them here and they give every distinct weight shape and the head the row-major walk's bits at
    every thread count, and ``ladder`` with ``chain_rows``: the most rows of ``CHAIN_ROW_CANDIDATES`` up to which a
    call runs all its rows through the kernel, where one pass of that many rows through every layer weight and the
    LM head is faster there (over the panels) than in the direct tiles, at that count and every smaller one, each
    count first held to the reference tile's bits (``batch_failure``). A row's bits in the kernel do not depend on
    its batch mates or on the weight's layout (``chain.c``), so both are chosen by time, like ``choose_lone``.

    Why: the kernel reads each weight once for all rows of a call, where each direct tile reads it again, and a
    panel's rows are contiguous, so its walk streams memory in order. Measured on an AVX2 EPYC (fp32, 2 threads,
    SmolLM2, ``bench/bench_decode_rows.py``): over panels 2.9x MKL's direct tiles at 8 rows, 1.9x at 32, 1.5x at 64,
    1.1x at 128. The panels are a second copy of the weights (538 MB for SmolLM2 in fp32)."""
    if not ladder.chain:
        return ladder, {}
    weights = {n.removesuffix(".weight"): model.w[n] for n in layer_weight_names(model.cfg)} | {UNEMBED: model.lm_head}
    panels = _panels(weights, ladder.chain, threads)
    chosen = 0
    for rows in CHAIN_ROW_CANDIDATES:
        way = dataclasses.replace(ladder, chain_rows=rows)
        if batch_failure(model, way, rows, threads) is not None:
            break
        tiles_seconds = _pass_seconds(model, ladder, {}, repeats, rows)
        if _kernel_seconds(weights, panels, ladder.chain, rows, repeats) >= tiles_seconds:
            break
        chosen = rows
    return dataclasses.replace(ladder, chain_rows=chosen), panels if chosen else {}


def _panels(weights: dict[str, torch.Tensor], block: int, threads: list[int]) -> dict[str, torch.Tensor]:
    """``weights`` as the kernel's panels, where it has them here and they give the walk's bits; else {}."""
    if not chain.has_panels() or any(w.dtype != torch.float32 for w in weights.values()):
        return {}
    panels = {name: chain.pack_panels(w) for name, w in weights.items()}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in {tuple(w.shape): name for name, w in weights.items()}.values():
            w = weights[name]
            x = torch.randn(13, w.shape[1], generator=gen)  # two whole groups of register rows and one short
            for n in threads:
                with at_threads(n):
                    walk = chain.chain_linear(x, w, block, [])
                    if differing(chain.chain_linear(x, w, block, [], panels[name]), walk):
                        return {}
    return panels


def _kernel_seconds(weights: dict[str, torch.Tensor], panels: dict[str, torch.Tensor], block: int, rows: int,
                    repeats: int) -> float:
    """Best of ``repeats`` passes of ``rows`` rows through every weight in Lathe's kernel, over ``panels`` where
    given."""
    def one_pass(xs: dict[int, torch.Tensor]) -> None:
        for name, w in weights.items():
            chain.chain_linear(xs[w.shape[1]], w, block, [], panels.get(name))

    return _best_pass(list(weights.values()), rows, repeats, one_pass)


def _best_pass(weights: list[torch.Tensor], rows: int, repeats: int,
               one_pass: Callable[[dict[int, torch.Tensor]], object]) -> float:
    """Best of ``repeats`` timed ``one_pass(xs)`` out of autograd, ``xs``: ``rows`` random rows (seed 0) of each of
    ``weights``' input widths, in their dtype on their device."""
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=gen).to(weights[0]) for k in sorted({w.shape[1] for w in weights})}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            one_pass(xs)
            best = min(best, time.perf_counter() - start)
    return best


def batch_failure(model: Decoder, ladder: tiling.Ladder, rows: int, threads: list[int]) -> str | None:
    """Where ``rows`` rows in one ``ops.linear`` call over ``ladder`` differ from their reference tile's products, for
    every distinct layer weight shape and the LM head at every thread count, or None where none does."""
    names = {tuple(model.w[n].shape): n for n in layer_weight_names(model.cfg)}.values()
    gen = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        for w in [*(model.w[n] for n in names), model.lm_head]:
            x = torch.randn(rows, w.shape[1], generator=gen).to(w.dtype)
            for n in threads:
                with at_threads(n):
                    bad = differing(ops.linear(x, w, invariant=True, ladder=ladder), ops.linear(x, w, invariant=True))
                if bad:
                    return f"linear {w.shape[1]}->{w.shape[0]}: row {bad[0]} of {rows} differs @{n} threads"
    return None


def _pass_seconds(model: Decoder, ladder: tiling.Ladder, packed: dict[str, torch.Tensor], repeats: int,
                  rows: int = 1) -> float:
    """Best of ``repeats`` passes of ``rows`` rows through every layer weight and the LM head (more than a cache
    holds, streamed as in decode) over ``ladder``, through the prepacked copies in ``packed`` where it has one."""
    names = layer_weight_names(model.cfg)
    weights = [(model.w[n], packed.get(n)) for n in names] + [(model.lm_head, None)]

    def one_pass(xs: dict[int, torch.Tensor]) -> None:
        for w, p in weights:
            ops.linear(xs[w.shape[1]], w, invariant=True, ladder=ladder, packed=p)

    return _best_pass([w for w, _ in weights], rows, repeats, one_pass)


def packed_agrees(model: Decoder, threads: list[int]) -> bool:
    """Whether rows fewer than ``model.ladder``'s smallest direct height (a lone decode row, or what a batch leaves
    over), zero-padded to it, come out of ``ops.prepacked_tile`` bitwise as out of ``ops.direct_tile``, for each
    distinct layer weight shape at every thread count (False where this torch has no oneDNN packing)."""
    height = min(model.ladder.direct)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in {tuple(model.w[n].shape): n for n in layer_weight_names(model.cfg)}.values():
            weight = model.w[name]
            packed = ops.prepack(weight, height)
            if packed is None:
                return False
            rows = torch.randn(height, weight.shape[1], generator=gen).to(weight.dtype)
            for live in range(1, height):  # a lone row, and every count of rows a batch may leave over
                tile = torch.nn.functional.pad(rows[:live], (0, 0, 0, height - live))
                for n in threads:
                    with at_threads(n):
                        if differing(ops.prepacked_tile(tile, packed), ops.direct_tile(tile, weight.t())):
                            return False
    return True


def choose_packed(model: Decoder, threads: list[int], repeats: int = 3) -> dict[str, torch.Tensor]:
    """Prepacked copies of ``model``'s layer weights (``ops.prepack``) for its lone decode rows, by weight name, or
    none. Where ``model.ladder`` zero-pads a lone row to a direct tile (``lone=0``), the library packs every weight
    again for each of those products; multiplying by a copy packed once is faster where it has the tile's bits.

    Admitted by bits first (``packed_agrees``, then many lone rows through the copies: ``lone_row_failure``;
    measured on an AVX-512 EPYC: equal in bf16, not in fp32), then timed, like ``choose_lone``, over every layer
    weight streamed as in decode, and kept only where faster. The copies cost the layer weights' bytes again (a
    sampling pool only). Not part of the fingerprint (``UNPRINTED``): it changes speed, never bits."""
    ladder = model.ladder
    if model.device.type != "cpu" or not ladder.direct or ladder.lone or ladder.chain \
            or not packed_agrees(model, threads):
        return {}
    height = min(ladder.direct)
    with torch.no_grad():
        copies = {n: ops.prepack(model.w[n], height) for n in layer_weight_names(model.cfg)}
    if lone_row_failure(model, ladder, threads, copies) is not None:
        return {}
    faster = _pass_seconds(model, ladder, copies, repeats) < _pass_seconds(model, ladder, {}, repeats)
    return copies if faster else {}


def choose_tiles(model: Decoder, lora_rank: int, *, backward: bool) -> None:
    """Set ``model``'s tiles for this machine: the linears' ladder with its lone-row way, the LoRA products' ladder
    at ``lora_rank``, the backward products' ladder for a training pool (``backward``) or, for a sampling pool, the
    rows its decode steps run through Lathe's product and the panels they read there, the prepacked layer weights of
    its lone decode rows and decode attention's kernel, and prefill attention's tiles, each chosen at the thread
    counts the pool may use."""
    threads = default_threads(model)
    model.ladder = choose_lone(model, choose_ladder(model_weights(model), threads, tiles_too=True), threads)
    if not backward:
        model.ladder, model.panels = choose_decode_rows(model, model.ladder, threads)
        model.packed = choose_packed(model, threads)
    model.lora_ladders = {lora_rank: choose_lora_ladder(model, lora_rank, threads)}
    if backward:
        model.grad_ladder = choose_ladder(backward_weights(model), threads)
    cfg = model.cfg
    model.attn_tiles = choose_attention_tiles(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                                              model.device, threads)
    if not backward:  # decode attention runs in a sampling pool only
        model.attn_chain = choose_attention_chain(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                                                  model.device, threads)
