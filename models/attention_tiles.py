"""Choosing attention's tiles on this machine (``tiles.choose_tiles`` sets them on the decoder), by bits, as
``lathe.models.tiles`` chooses the linears': ``choose_attention_tiles`` picks prefill attention's row tiles
(``attn.ATTN_ROW_TILE``, the one decode uses, plus each of ``attn.ATTN_TILE_CANDIDATES`` whose prefill and chunked
prefill have its bits); ``choose_attention_chain`` admits Lathe's own kernel for decode attention's products where it
has the library's bits.
"""

from __future__ import annotations

import torch

from lathe.kernels import attention as attn
from lathe.kernels import chain, ops
from lathe.models.trials import ATTENTION_LENGTH, ATTENTION_SPLITS, at_threads, differing


def _attention_tile_agrees(tile: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threads: list[int]) -> bool:
    """Whether prefill attention in ``tile``-row tiles has the reference tile's bits, whole and in the chunked
    prefills of ``ATTENTION_SPLITS`` (every part at its own offset, so rows sit at other tile positions)."""
    scale = q.shape[-1] ** -0.5
    for n in threads:
        with at_threads(n):
            ref = attn.attention(q, k, v, q_offset=0, scale=scale, invariant=True)
            for s0, s1 in [(0, len(q)), *zip(ATTENTION_SPLITS, ATTENTION_SPLITS[1:], strict=False)]:
                part = attn.attention(q[s0:s1], k[:s1], v[:s1], q_offset=s0, scale=scale, invariant=True,
                                     tiles=(tile,))
                if differing(part, ref[s0:s1]):
                    return False
    return True


def choose_attention_tiles(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                           threads: list[int], seed: int = 0) -> tuple[int, ...]:
    """Prefill attention's tile ladder on this machine: ``attn.ATTN_ROW_TILE`` and every
    ``attn.ATTN_TILE_CANDIDATES`` height whose prefill rows are bitwise the reference tile's, for the model's
    head shapes at each thread count. Decided by bits, like ``choose_row_tiles``; off the CPU the products do
    not depend on row tiles, so the ladder is the reference tile alone.
    """
    if device.type != "cpu":
        return (attn.ATTN_ROW_TILE,)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(ATTENTION_LENGTH, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    with torch.no_grad():
        chosen = [t for t in attn.ATTN_TILE_CANDIDATES if _attention_tile_agrees(t, q, k, v, threads)]
    return tuple(sorted({attn.ATTN_ROW_TILE, *chosen}))


ATTENTION_CHAIN_POSITIONS = (0, 37, 64, 130, ATTENTION_LENGTH - 1)
"""Positions of the sequences ``choose_attention_chain`` decodes: one chunk, a chunk's end, several chunks, and
chunks wholly past a shorter sequence's end."""


def choose_attention_chain(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                           threads: list[int], seed: int = 0) -> int:
    """The first k-block of ``chain.BLOCKS`` whose fixed-order kernel gives invariant decode attention
    (``attn.decode_attention(..., chain=block)``) the bits of its library products, for the model's head shapes,
    one sequence alone and ``ATTENTION_CHAIN_POSITIONS`` together, at each thread count; 0 where none does, off the
    CPU, for fp64 (the kernel is fp32), or where the kernel cannot be built here. Decided by bits; the self-check
    then decodes with it."""
    if device.type != "cpu" or ops._wide(dtype) != torch.float32 or not chain.available() or head_dim > chain.MAX_HEAD:
        return 0
    gen = torch.Generator().manual_seed(seed)
    count, slots = len(ATTENTION_CHAIN_POSITIONS), -(-ATTENTION_LENGTH // attn.KEY_CHUNK) * attn.KEY_CHUNK
    q = torch.randn(count, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(count, slots, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    for s, p in enumerate(ATTENTION_CHAIN_POSITIONS):  # spare slots hold zeros, as a KV cache's do
        k[s, p + 1:], v[s, p + 1:] = 0, 0
    cases = [(q[-1:], k[-1:], v[-1:], [ATTENTION_CHAIN_POSITIONS[-1]]), (q, k, v, list(ATTENTION_CHAIN_POSITIONS))]

    def agrees(block: int) -> bool:
        for n in threads:
            with at_threads(n):
                for case in cases:
                    ref = attn.decode_attention(*case, scale=head_dim**-0.5, invariant=True)
                    if differing(attn.decode_attention(*case, scale=head_dim**-0.5, invariant=True, chain=block), ref):
                        return False
        return True

    with torch.no_grad():
        return next((block for block in chain.BLOCKS if agrees(block)), 0)
