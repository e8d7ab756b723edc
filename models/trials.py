"""The trials that hold a way of computing to the reference bits, shared by tile choice (``lathe.models.tiles``) and
the exactness self-check (``lathe.models.exactness``, ``lathe.models.checks``), so that a pool checks its tiles on
the terms it chose them on.

Owns the row counts of the batches an op's rows are compared in (``BATCH_ROWS``), the attention trials' length and
chunked-prefill cuts (``ATTENTION_LENGTH``, ``ATTENTION_SPLITS``), the comparison itself (``differing``: the rows
whose bits differ, NaN equal to NaN) at a given thread count (``at_threads``), and the lone-row trial:
``lone_row_failure`` runs rows one a call through ``ops.linear`` over a ladder (a decode step of one sequence)
against the same rows' reference products, ``trial_rows`` of each weight (many more in a narrow dtype, where an
output shows a difference only next to a rounding boundary: ``LONE_OUTPUTS``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lathe.kernels import ops, tiling
from lathe.models.decoder import Decoder, layer_weight_names

BATCH_ROWS = (1, 3, 13, 17, 64, 300)
"""Row counts of the batches each op's rows are compared in: a lone row, counts that leave a tile part full, and
several tiles' worth."""

ATTENTION_LENGTH = 300
"""Keys of the attention check: past 256, where one long key reduction changed bits (measured)."""

ATTENTION_SPLITS = (0, 1, 4, 17, 64, 150, 257, ATTENTION_LENGTH)
"""Where the attention checks cut the sequence into chunked prefills (each part at its own offset)."""


@contextmanager
def at_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def differing(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Indices along dim 0 where a and b differ in any element (NaN equal to NaN)."""
    same = (a == b) | (a.isnan() & b.isnan())
    return same.reshape(a.shape[0], -1).all(-1).logical_not().nonzero().flatten().tolist()


LONE_OUTPUTS = 1 << 16
"""Outputs of each weight a trial computes in a narrow dtype (bf16, fp16; ``trial_rows``): ``LONE_OUTPUTS // N`` rows
of an ``[N, K]`` weight, between ``LONE_ROWS`` and 2048, in the row pools of tile choice (``lathe.models.tiles``)
and as lone rows, one a call, in ``lone_row_failure`` (and as many again in the self-check, on other rows). A
narrow output hides an accumulation that differs by an ulp of fp32 unless it lies next to a rounding boundary:
measured on an AVX-512 EPYC with avx512_bf16, a one-row bf16 product (the library's matrix-vector kernel) rounded
3-10 of 131072-524288 outputs of the tiny Qwen3-MoE's weights otherwise than their tile, none of them in the first
rows a smaller trial runs."""

LONE_ROWS = 8
"""Lone rows of each weight ``lone_row_failure`` runs in fp32 or wider, where an output shows every difference."""


def trial_rows(outputs: int, dtype: torch.dtype) -> int:
    """Rows a trial computes of a weight with ``outputs`` outputs a row: ``LONE_ROWS`` in fp32 or wider, enough for
    ``LONE_OUTPUTS`` outputs (at most 2048 rows) in a narrow dtype."""
    if dtype.itemsize >= 4:
        return LONE_ROWS
    return min(2048, max(LONE_ROWS, LONE_OUTPUTS // outputs))


def lone_row_failure(model: Decoder, ladder: tiling.Ladder, threads: list[int],
                     packed: dict[str, torch.Tensor] | None = None, seed: int = 0) -> str | None:
    """Where one row alone in its ``ops.linear`` call over ``ladder`` (a decode step of one sequence; through
    ``packed``'s prepacked copy where it has one) differs from the same rows' reference products, for every distinct
    layer weight shape and the LM head at every thread count, or None where none does. ``trial_rows`` rows of
    ``seed`` a weight, each in its own call; only on the CPU, where a ladder runs lone rows its own way."""
    if model.device.type != "cpu":
        return None
    packed = packed or {}
    names = {tuple(model.w[n].shape): n for n in layer_weight_names(model.cfg)}.values()
    weights = [(n.removesuffix(".weight").rpartition(".")[2], model.w[n], packed.get(n)) for n in names]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for label, w, copy in [*weights, ("lm_head", model.lm_head, None)]:
            rows = torch.randn(trial_rows(w.shape[0], w.dtype), w.shape[1], generator=gen).to(w.dtype)
            for n in threads:
                with at_threads(n):
                    lone = torch.cat([ops.linear(rows[i:i + 1], w, invariant=True, ladder=ladder, packed=copy)
                                      for i in range(rows.shape[0])])
                    bad = differing(lone, ops.linear(rows, w, invariant=True))
                if bad:
                    return (f"linear {label} {w.shape[1]}->{w.shape[0]}: lone row {bad[0]} of {rows.shape[0]} "
                            f"differs from its reference tile @{n} threads")
    return None
