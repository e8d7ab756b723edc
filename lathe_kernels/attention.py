"""Causal grouped-query attention in the batch-invariant mode and the plain torch mode (``lathe.kernels.ops``
states the modes and why the invariant one gets its bits; this module is its attention).

    attention(q, k, v, q_offset, scale) -> o           (causal, one sequence, grouped-query heads)
      q: [Lq, Hq, D]; k, v: [Lk, Hkv, D]; Hq = g * Hkv, query head h reads kv head h // g
      query i sits at absolute position q_offset + i and sees keys 0 .. q_offset + i
      o[i, h] = softmax(scale * q[i, h] @ k[:q_offset+i+1, h // g].T) @ v[:q_offset+i+1, h // g]
                                                                            -> o: [Lq, Hq, D]
      Training and prefill: q_offset = 0, Lk = Lq. Chunked prefill: q_offset = tokens already cached.
      attention_batch(q, k, v): S sequences of one length at once, q [S, L, Hq, D], k, v [S, L, Hkv, D],
      o[s] = attention(q[s], k[s], v[s], q_offset=0)                      -> o: [S, L, Hq, D]
      Decode: Lq = 1, q_offset = Lk - 1. Keys past q_offset + Lq - 1 never reach the result: a KV
      cache may be passed with spare slots, which must hold finite values (zeros).

How the invariant mode gets its bits. Keys are cut into chunks of ``KEY_CHUNK`` on the absolute key
grid from key 0; the ``g`` query heads of a kv head are consecutive rows, cut into tiles of T rows
(decode: ``ATTN_ROW_TILE``; prefill: the largest height of the pool's attention ladder that the rows
fill, admitted by the self-check only where its rows have the ``ATTN_ROW_TILE`` tile's bits); scores
are ``[T, D] @ [D, KEY_CHUNK]`` products and each chunk's probabilities meet its values in
``[T, KEY_CHUNK] @ [KEY_CHUNK, D]`` products and are summed over the chunk's 64 keys (the softmax
denominator: a row-wise sum, invariant like ``log_softmax``); chunk results are added one by one in
chunk order. A kv head's key and value blocks are strided views of the ``[N, Hkv, D]`` rows a KV cache
holds (leading dimension Hkv * D in prefill and decode alike), never copied. A key in a row's future
scores -inf, so a chunk wholly in its future adds exactly 0 (prefill never computes it; decode adds
its zeros). The row max that stabilises exp is exact in any order. Scores, sums and the output before
its final cast are fp32 (fp64 for fp64 input).
Training differentiates through ``_InvariantAttention``, whose backward has the same per-sequence property.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from lathe.kernels import chain as chain_kernel
from lathe.kernels import ops

ATTN_ROW_TILE = 4
"""Query rows (a GQA group's heads, then the next query's) per attention product in invariant mode: the
reference height, and the one decode uses (a decoded token's group of heads fills one tile)."""

ATTN_TILE_CANDIDATES = (16, 64)
"""Taller attention tiles a pool may add to its prefill ladder (``attention``'s ``tiles``) when its self-check
finds their rows bitwise equal to the reference tile's (``lathe.models.attention_tiles.choose_attention_tiles``)."""

KEY_CHUNK = 64
"""Width of the fixed key chunks of invariant attention, on the absolute key grid."""



def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, scale: float, invariant: bool,
    tiles: tuple[int, ...] = (ATTN_ROW_TILE,),
) -> torch.Tensor:
    """Causal grouped-query attention of one sequence; q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D].

    o[i, h] = softmax(scale * q[i, h] @ k[:q_offset+i+1, h // g].T) @ v[:q_offset+i+1, h // g],
    g = Hq // Hkv. Needs q_offset + Lq <= Lk; keys from q_offset + Lq on are ignored (they must be
    finite: spare KV-cache slots hold zeros). The output has q's dtype. Differentiable in both modes
    (the trainer backpropagates through it). Invariant mode cuts each kv head's Lq * g query rows into
    tiles of the tallest height in ``tiles`` that they fill (the smallest when they fill none).
    """
    lq, hq, d = q.shape
    lk, hkv, dk = k.shape
    if v.shape != k.shape or dk != d:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be [Lk, Hkv, {d}]")
    if hq % hkv:
        raise ValueError(f"attention: query heads Hq={hq} is not a multiple of kv heads Hkv={hkv}")
    if q_offset < 0 or q_offset + lq > lk:
        raise ValueError(f"attention: q_offset={q_offset} with Lq={lq} queries needs 0 <= q_offset <= Lk-Lq, Lk={lk}")
    if invariant:
        return _invariant_attention(q[None], k[None], v[None], q_offset, scale, tiles)[0]
    return _sdpa_attention(q, k, v, q_offset, scale)


def attention_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, invariant: bool,
    tiles: tuple[int, ...] = (ATTN_ROW_TILE,),
) -> torch.Tensor:
    """Causal attention of S sequences of one length, each from its first token; q [S, L, Hq, D],
    k/v [S, L, Hkv, D] -> [S, L, Hq, D].

    o[s] = attention(q[s], k[s], v[s], q_offset=0), bit for bit in invariant mode: every product has the
    shape and transposition it has for the sequence alone (a key chunk is copied where alone it is a view: the
    pool's self-check holds the two to the same bits), and the sums run in the same order, but each kind of
    product runs once for all S sequences (a training pass's attention costs a few ops per layer, not a few per
    sequence). Differentiable, with gradients that do not depend on S either.
    """
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"attention_batch: q {tuple(q.shape)} must be [S, L, Hq, D] and k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} [S, L, Hkv, D]")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention_batch: query heads Hq={q.shape[2]} is not a multiple of kv heads "
                         f"Hkv={k.shape[2]}")
    if invariant:
        return _invariant_attention(q, k, v, 0, scale, tiles)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def _invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,
                         tiles: tuple[int, ...]) -> torch.Tensor:
    """Invariant attention of S sequences sharing ``q_offset``: q [S, Lq, Hq, D], k/v [S, Lk, Hkv, D]."""
    rows = q.shape[1] * (q.shape[2] // k.shape[2])
    tile = max((t for t in tiles if t <= rows), default=min(tiles))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _InvariantAttention.apply(q, k, v, q_offset, scale, tile)
    return _chunked_attention(q, k, v, q_offset, scale, tile)


class _InvariantAttention(torch.autograd.Function):
    """Invariant attention under autograd: the forward is ``_chunked_attention`` itself (the same bits),
    run without recording a graph, and only q, k, v and the output are saved. Backward recomputes the
    probabilities of each sequence's visible keys in one product per head and applies the softmax gradient
    (dS = P * (dP - rowsum(dO * O))), in fp32 or wider: a few products per layer instead of autograd's
    thousands of small kernels and zero-filled slices. Every operand has one layout whatever the number of
    sequences and every product runs on one thread (``_bmm``), so a sequence's gradient bits depend on the
    sequence alone and a tenant's gradient does not depend on its batch mates."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,  # noqa: ANN001
                tile: int) -> torch.Tensor:
        out = _chunked_attention(q, k, v, q_offset, scale, tile)
        ctx.save_for_backward(q, k, v, out)
        ctx.q_offset, ctx.scale = q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        q, k, v, out = ctx.saved_tensors
        s, lq, hq, d = q.shape
        lk, hkv = k.shape[1], k.shape[2]
        g, n, wide = hq // hkv, ctx.q_offset + lq, ops._wide(q.dtype)

        def heads(x: torch.Tensor) -> torch.Tensor:  # [S, L, H, D] -> [S, H, L, D], contiguous, in the wide dtype
            return x.to(wide).transpose(1, 2).contiguous()

        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [S, H, m, k] @ [S, H, k, n] -> [S, H, m, n]
            return ops._bmm(a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:])).view(*a.shape[:3], b.shape[3])

        qh, dout, oh = heads(q), heads(grad), heads(out)
        kh, vh = (heads(x[:, :n]).repeat_interleave(g, dim=1) for x in (k, v))  # query head h reads h // g
        future = torch.arange(n, device=q.device) > ctx.q_offset + torch.arange(lq, device=q.device)[:, None]
        p = torch.softmax(mm(qh, kh.transpose(2, 3)).mul_(ctx.scale).masked_fill_(future, float("-inf")), -1)
        dp = mm(dout, vh.transpose(2, 3))
        ds = p * (dp - (dout * oh).sum(-1, keepdim=True))
        dq = mm(ds, kh).mul_(ctx.scale).transpose(1, 2).to(q.dtype)

        def per_kv_head(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # [S, Hq, n, D] -> [S, Lk, Hkv, D]
            x = x.view(s, hkv, g, n, d)
            total = x[:, :, 0]
            for j in range(1, g):  # a group's heads added in order
                total = total + x[:, :, j]
            total = total.transpose(1, 2).to(like.dtype)
            return F.pad(total, (0, 0, 0, 0, 0, lk - n)) if lk > n else total

        dk = per_kv_head(mm(ds.transpose(2, 3), qh).mul_(ctx.scale), k)
        dv = per_kv_head(mm(p.transpose(2, 3), dout), v)
        return dq, dk, dv, None, None, None


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
    lq, lk = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if q_offset == 0 and lq == lk:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # is_causal aligns the mask top-left, so an offset needs it spelled out
        keys = torch.arange(lk, device=q.device)
        visible = keys <= q_offset + torch.arange(lq, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _keys(x: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """x[:, :n] ([S, Lk, Hkv, D] keys or values) in ``dtype``, zero rows appended up to n: the [S, n, Hkv, D]
    grid whose [KEY_CHUNK, D] blocks (one kv head's slice, a strided view) the products read.

    Keys from q_offset + Lq on are in every query's future, scored -inf and weighted exactly 0, so
    whatever finite value fills them (zeros here and in a caller's spare KV-cache slots) never reaches a
    result bit.
    """
    x = x[:, :n].to(dtype)
    return F.pad(x, (0, 0, 0, 0, 0, n - x.shape[1])) if x.shape[1] < n else x


def _per_tile(lhs: torch.Tensor, x: torch.Tensor, c: int, h: int, transpose: bool) -> torch.Tensor:
    """lhs [S, m, t, K] (m row tiles of each sequence) times key chunk c of kv head h of x [S, n, Hkv, D]
    (``.T`` when ``transpose``) -> [S, m, t, N]: one [t, K] product per tile, the chunk read in one layout.

    One sequence's tiles share its chunk as a view expanded over them; several sequences' chunks are copied
    once per tile (the batch then has one chunk per product), rows of D values as in the cache, transposed the
    same way.
    """
    s, m = lhs.shape[:2]
    block = x[:, c * KEY_CHUNK : (c + 1) * KEY_CHUNK, h]  # [S, 64, D]
    if s == 1:
        block = block[0].expand(m, *block.shape[1:])
    else:
        block = block[:, None].expand(s, m, *block.shape[1:]).reshape(s * m, *block.shape[1:])
    out = ops._bmm(lhs.reshape(s * m, *lhs.shape[2:]), block.transpose(1, 2) if transpose else block)
    return out.view(s, m, *out.shape[1:])


def _chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,
                       t: int) -> torch.Tensor:
    """Invariant attention of S sequences sharing ``q_offset``: q [S, Lq, Hq, D], k/v [S, Lk, Hkv, D]."""
    s, lq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    wide = ops._wide(q.dtype)
    # Row i * g + j of kv head h is query i of head h * g + j: a GQA group is consecutive rows.
    # Padding rows sit past the last query and take its position, so they stay finite.
    rows = (q.to(wide) * scale).reshape(s, lq, hkv, g, d).transpose(1, 2).reshape(s, hkv, lq * g, d)
    rows = ops._pad_rows(rows, t)
    tiles = rows.shape[2] // t
    mine = rows.view(s, hkv, tiles, t, d)
    chunks = (q_offset + lq - 1) // KEY_CHUNK + 1  # up to the last key any query sees
    keys, values = (_keys(x, chunks * KEY_CHUNK, wide) for x in (k, v))  # [S, n, Hkv, D]
    position = q_offset + torch.arange(tiles * t, device=q.device).clamp(max=lq * g - 1) // g  # [R]
    firsts, lasts = position[::t].tolist(), position[t - 1 :: t].tolist()  # each tile's first and last row
    # Chunk c meets tiles[seen[c]:] (a tile before seen[c] has the whole chunk in its future); of those, the
    # tiles before whole[c] see only part of it and mask the rest. Chunks a tile never sees are never computed.
    seen = [bisect.bisect_left(lasts, c * KEY_CHUNK) for c in range(chunks)]
    whole = [bisect.bisect_left(firsts, (c + 1) * KEY_CHUNK - 1) for c in range(chunks)]
    key = torch.arange(KEY_CHUNK, device=q.device)

    scores = []  # chunk c: [S, Hkv, tiles - seen[c], t, 64]
    for c in range(chunks):
        f, e = seen[c], whole[c]
        sc = torch.stack([_per_tile(mine[:, h, f:], keys, c, h, transpose=True) for h in range(hkv)], dim=1)
        if e > f:
            future = c * KEY_CHUNK + key > position[f * t : e * t].view(e - f, t, 1)
            sc[:, :, : e - f].masked_fill_(future, float("-inf"))
        scores.append(sc)
    # The row max only stabilises exp (the result does not depend on it, so it carries no gradient); it is
    # exact in any order. Every row sees key 0, so it is finite.
    with torch.no_grad():
        top = scores[0].amax(-1, keepdim=True)
        for c in range(1, chunks):
            top[:, :, seen[c] :] = torch.maximum(top[:, :, seen[c] :], scores[c].amax(-1, keepdim=True))
    # Each chunk's probabilities meet its values (numerators) and are summed (denominators); chunk results are
    # added one by one in chunk order, as decode adds them.
    def chunk_result(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.exp(scores[c] - top[:, :, seen[c] :])
        num = torch.stack([_per_tile(p[:, h], values, c, h, transpose=False) for h in range(hkv)], dim=1)
        return num, p.sum(-1, keepdim=True)

    num, den = chunk_result(0)
    for c in range(1, chunks):
        part, total = chunk_result(c)
        num[:, :, seen[c] :] += part
        den[:, :, seen[c] :] += total
    out = (num / den).reshape(s, hkv, tiles * t, d)[:, :, : lq * g]
    return out.reshape(s, hkv, lq, g, d).transpose(1, 2).reshape(s, lq, hq, d).to(q.dtype)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | list[int], *, scale: float,
    invariant: bool, chain: int = 0, table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token for each of S sequences at once; q [S, Hq, D], k/v [S, N, Hkv, D] -> [S, Hq, D].

    o[s] = attention(q[s][None], k[s], v[s], q_offset=positions[s])[0]: sequence s's token sits at
    ``positions[s]`` and sees its keys 0..positions[s]; rows past that (padding, N >= every
    positions[s] + 1) must be finite. In invariant mode every bit equals ``attention`` called per
    sequence: the same row tiles of GQA groups, the same fixed-shape products per key chunk on the same
    grid, the same exact max, and the same chunk-ordered sums (chunks past a sequence's end add exactly
    zero). ``positions`` may be an int64 tensor on q's device ([S]; what a captured CUDA graph reads: no
    host value enters the computation), or a list.

    ``chain`` (a pool's ``Decoder.attn_chain``, admitted by ``lathe.models.attention_tiles.choose_attention_chain``
    where it gives these bits): the products run in Lathe's own fixed-order kernel with k-blocks of that size
    (``lathe.kernels.chain.attention_scores`` and ``attention_values``), a few calls a layer instead of a few
    small library products per kv head and chunk, each of which wakes the library's threads; the exponentials
    and the per-chunk sums stay torch's.

    ``table`` ([S, C] int64 block ids): k and v are a paged cache's blocks [B, KEY_CHUNK, Hkv, D] and sequence s's
    keys are blocks table[s] in order, the same attention as over those blocks copied out. The kernel reads fp32
    blocks in place; otherwise they are copied out first.
    """
    chain = chain if invariant else 0
    if table is not None and not (chain and k.dtype == torch.float32):  # blocks copied out, in table order
        k, v = (x.index_select(0, table.reshape(-1)).view(table.shape[0], -1, *x.shape[2:]) for x in (k, v))
        table = None
    if chain:
        wide, pos = ops._wide(q.dtype), torch.as_tensor(positions, dtype=torch.long)
        x = chain_kernel.attention_scores(q.to(wide), k.to(wide), pos, scale, chain, table)
        p = torch.exp(x)
        return chain_kernel.attention_values(p, p.sum(-1), v.to(wide), pos, chain, table).to(q.dtype)
    s, hq, d = q.shape
    _, n, hkv, _ = k.shape
    g = hq // hkv
    if not invariant:
        keys = torch.arange(n, device=q.device)
        visible = keys <= torch.as_tensor(positions, device=q.device)[:, None]  # [S, N]
        o = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=visible[:, None, None], scale=scale, enable_gqa=True)
        return o[:, :, 0]
    if n % KEY_CHUNK:
        raise ValueError(f"decode_attention: N={n} keys must be whole chunks of {KEY_CHUNK}")
    wide, t, chunks = ops._wide(q.dtype), ATTN_ROW_TILE, n // KEY_CHUNK
    keys, values = k.to(wide), v.to(wide)  # [S, N, Hkv, D]: kv head h's chunks are strided views, never copied
    rows = ops._pad_rows((q.to(wide) * scale).reshape(s, hkv, g, d), t)  # [S, Hkv, G, D], G whole tiles
    tiles = rows.shape[2] // t
    # Per (kv head, tile): one [t, D] @ [D, 64] product per (sequence, chunk), the tile's rows shared by its chunks
    mine = rows.view(s, hkv, tiles, 1, t, d).expand(s, hkv, tiles, chunks, t, d)
    pairs = [(h, j) for h in range(hkv) for j in range(tiles)]

    def chunked(x: torch.Tensor, h: int) -> torch.Tensor:
        return x[:, :, h].reshape(s * chunks, KEY_CHUNK, d)  # [S * C, 64, D]

    scores = torch.stack([ops._bmm(mine[:, h, j].reshape(-1, t, d), chunked(keys, h).transpose(1, 2))
                          for h, j in pairs])
    pos = torch.as_tensor(positions, device=q.device)
    future = torch.arange(n, device=q.device).view(chunks, 1, KEY_CHUNK) > pos.view(-1, 1, 1, 1)  # [S, C, 1, 64]
    scores = scores.view(len(pairs), s, chunks, t, KEY_CHUNK).masked_fill(future, float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=(2, 4), keepdim=True))
    num = torch.stack([ops._bmm(probs[i].view(-1, t, KEY_CHUNK), chunked(values, h)) for i, (h, _) in enumerate(pairs)])
    num = num.view(len(pairs), s, chunks, t, d)
    den = probs.sum(-1, keepdim=True)
    acc, total = num[:, :, 0], den[:, :, 0]
    for c in range(1, chunks):  # chunks past a sequence's end add exactly zero
        acc, total = acc + num[:, :, c], total + den[:, :, c]
    out = (acc / total).view(hkv, tiles, s, t, d).permute(2, 0, 1, 3, 4).reshape(s, hkv, tiles * t, d)[:, :, :g]
    return out.reshape(s, hq, d).to(q.dtype)
