"""The ops Lathe's decoder calls, in a batch-invariant mode and a plain torch mode.

Trainer and sampler run the same decoder through these ops. With ``invariant=True`` a row's (a
token's) result has the same bits whatever the batch: how many rows there are, what the other rows
hold, padding, and whether the token is computed in a prefill or decoded alone against a KV cache.
That is what makes the logprob the sampler reports bitwise equal to the one the trainer computes
(DESIGN.md section 3). With ``invariant=False`` each op is the plain, fastest torch call; values agree
with the invariant mode to rounding, bits do not. The mode is an argument, never global state.

    linear(x, weight, bias) -> y
      x: [..., K]; weight: [N, K]; bias: [N] or None
      y = x @ weight.T + bias                                               -> y: [..., N]

    rms_norm(x, weight, eps) -> y                      (Llama RMSNorm, statistics in fp32 or wider)
      x: [..., D]; weight: [D]
      y = weight * (x / sqrt(mean(x ** 2, -1) + eps)).to(x.dtype)           -> y: [..., D]

    log_softmax(x, dim) -> y
      y = x - logsumexp(x, dim), computed and returned in fp32 or wider     -> y: x.shape

    attention(q, k, v, q_offset, scale) -> o           (causal, one sequence, grouped-query heads)
      q: [Lq, Hq, D]; k, v: [Lk, Hkv, D]; Hq = g * Hkv, query head h reads kv head h // g
      query i sits at absolute position q_offset + i and sees keys 0 .. q_offset + i
      o[i, h] = softmax(scale * q[i, h] @ k[:q_offset+i+1, h // g].T) @ v[:q_offset+i+1, h // g]
                                                                            -> o: [Lq, Hq, D]
      Training and prefill: q_offset = 0, Lk = Lq. Chunked prefill: q_offset = tokens already cached.
      Decode: Lq = 1, q_offset = Lk - 1. Keys past q_offset + Lq - 1 never reach the result: a KV
      cache may be passed with spare slots, which must hold finite values (zeros).

How the invariant mode gets its bits (measured with torch 2.13 CPU; EXACTNESS.md has the recipe):
- Matmuls: a row's result depends on the row count M when M is small (fp32, 2 threads: M in
  1-3, 5-7 and 9-11; 1 thread: M in 1-3). ``linear`` pads M up to a multiple of 4 (at least 4) with
  zero rows, which gives every row the bits it has in any larger batch.
- ``log_softmax`` over the last dim is already row-invariant in plain torch (its kernel splits the
  work over rows only), so both modes share the code. ``rms_norm`` is too, except that torch splits
  the mean of a lone row across threads once it has more than 32768 elements; the invariant mode
  gives a lone row a zero partner row. Both modes share the rest.
- ``attention``: ``F.scaled_dot_product_attention`` gives a token different bits in prefill and in
  decode (149 of 150 fp32 tokens here). The invariant mode fixes every reduction to the absolute key
  grid: keys are cut into chunks of ``KEY_CHUNK`` from key 0, each chunk's probabilities meet its
  values in their own K=64 matmul, and chunk results are added one by one in chunk order (measured:
  one P @ V over all keys, or a torch.sum over the chunks, changes a row's bits once the keys pass
  256 and the count differs between prefill and decode). A key in a query's future scores -inf,
  so a chunk wholly in its future adds exactly 0; decode does not even load it. The row max that
  stabilises exp is exact in any order. The g query heads of a kv head are the
  rows of one matmul (padded to a multiple of 4, in blocks of ``ROW_BLOCK`` rows); scores, sums
  and the output before its final cast are fp32 (or wider) whatever the input dtype.
  Unlike the recipe this is not an online (running-max) softmax: one matmul gives a block of rows
  all its chunk scores (a column's bits do not depend on how many columns there are, measured), so
  the max is known before exp and nothing is rescaled. Same invariance, fewer ops; the price is
  [Hkv, ROW_BLOCK, Lk] scores per block, kept for backward under autograd as SDPA's math path does.
Backward passes go through torch autograd in both modes (only the forward is batch-invariant).

The invariant mode's bits were also the same at 1, 2, 3 and 4 threads, so a trainer and a sampler
with different thread budgets still agree (tested at 1 and 2).

Cost: the recipe's author measured invariant/plain on one SmolLM2-135M layer with 2 threads at
x0.98-1.10 for an 8x256 forward and x1.23-1.25 for a 32-sequence decode step, with their attention.
This attention runs a few dozen small torch ops per call where SDPA runs one kernel, a fixed cost
that decode pays once per sequence per layer. ``bench/bench_invariance.py`` measures both; run it
with nothing else on the cores before relying on any figure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 4
"""Matmul row counts are padded to a multiple of this (and to at least this) in invariant mode."""

KEY_CHUNK = 64
"""Width of the fixed key chunks of invariant attention, on the absolute key grid."""

ROW_BLOCK = 256
"""Query rows per score matmul of invariant attention (a multiple of ROW_MULTIPLE). Bounds the scores
held at once, and lets a block skip the key chunks that are in the future of all its rows."""


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are kept in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended along dim -2 so that its size is a positive multiple of ``multiple``."""
    rows = x.shape[-2]
    target = max(multiple, -(-rows // multiple) * multiple)
    return x if target == rows else F.pad(x, (0, 0, 0, target - rows))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, invariant: bool) -> torch.Tensor:
    """y = x @ weight.T + bias; x [..., K], weight [N, K], bias [N] or None -> y [..., N].

    Invariant mode flattens the leading dims to M rows, pads M to a multiple of ``ROW_MULTIPLE`` with
    zero rows and drops them from the result. Differentiable in both modes.
    """
    if not invariant:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    y = F.linear(_pad_rows(rows, ROW_MULTIPLE), weight, bias)
    return y[: rows.shape[0]].reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, invariant: bool) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x ** 2, -1) + eps)).to(x.dtype); x [..., D], weight [D] -> [..., D].

    The statistic is computed in fp32 (fp64 for fp64 input), as Llama-family models do. Row-invariant
    in both modes except for a lone row of more than 32768 elements, which only the invariant mode
    handles (it reduces the row next to a zero row, as it would be in any batch).
    """
    xf = x.to(_wide(x.dtype))
    rows = xf.reshape(-1, xf.shape[-1])
    n = rows.shape[0]
    if invariant and n == 1:
        rows = _pad_rows(rows, 2)
    mean_sq = rows.pow(2).mean(-1, keepdim=True)[:n].reshape(*x.shape[:-1], 1)
    return weight * (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, *, invariant: bool) -> torch.Tensor:
    """y = x - logsumexp(x, dim), in fp32 (fp64 for fp64 input) -> y: x.shape.

    Plain ``torch.log_softmax`` over the last dim is already row-invariant (measured for 1-256 rows
    of up to 100000 entries, 1 and 2 threads), so both modes run the same code; ``invariant`` is
    accepted so that every op of the decoder takes the same switch.
    """
    return torch.log_softmax(x.to(_wide(x.dtype)), dim)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, scale: float, invariant: bool
) -> torch.Tensor:
    """Causal grouped-query attention of one sequence; q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D].

    o[i, h] = softmax(scale * q[i, h] @ k[:q_offset+i+1, h // g].T) @ v[:q_offset+i+1, h // g],
    g = Hq // Hkv. Needs q_offset + Lq <= Lk; keys from q_offset + Lq on are ignored (they must be
    finite: spare KV-cache slots hold zeros). The output has q's dtype. Differentiable in both modes
    (the trainer backpropagates through it).
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
        return _chunked_attention(q, k, v, q_offset, scale)
    return _sdpa_attention(q, k, v, q_offset, scale)


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


def _on_grid(x: torch.Tensor, n: int, dtype: torch.dtype, ones_column: bool = False) -> torch.Tensor:
    """x[:n] as [Hkv, n, D] in ``dtype``, plus a last column of ones if ``ones_column``.

    Slots past the end of x are filled with ones. Keys from q_offset + Lq on are in every query's
    future, scored -inf and weighted exactly 0, so whatever finite value fills them (ones here, zeros
    in a caller's spare KV-cache slots) never reaches a result bit.
    """
    x = x[:n].to(dtype).transpose(0, 1)
    pad = (0, int(ones_column), 0, n - x.shape[1])
    return F.pad(x, pad, value=1.0) if any(pad) else x


def _chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
    lq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    wide = _wide(q.dtype)
    # Row i * g + j of kv head h is query i of head h * g + j: a GQA group is the rows of one matmul.
    # Padding rows sit past the last query; they see every key loaded, so they stay finite.
    rows = (q.to(wide) * scale).reshape(lq, hkv, g, d).transpose(0, 1).reshape(hkv, lq * g, d)
    rows = _pad_rows(rows, ROW_MULTIPLE)
    last_key = q_offset + lq - 1  # the last key any query sees
    n_keys = (last_key // KEY_CHUNK + 1) * KEY_CHUNK
    keys = _on_grid(k, n_keys, wide).transpose(1, 2)  # [Hkv, D, n_keys]
    # A ones column after v makes each chunk's value matmul also sum its probabilities (the denominator).
    values = _on_grid(v, n_keys, wide, ones_column=True)  # [Hkv, n_keys, D + 1]
    blocks = []
    for r0 in range(0, rows.shape[1], ROW_BLOCK):
        block = rows[:, r0 : r0 + ROW_BLOCK]
        block_last = min(q_offset + (r0 + block.shape[1] - 1) // g, last_key)
        blocks.append(_attention_rows(block, keys, values, r0, g, q_offset, block_last))
    out = (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1))[:, : lq * g]
    return out.reshape(hkv, lq, g, d).transpose(0, 1).reshape(lq, hq, d).to(q.dtype)


def _attention_rows(
    rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, r0: int, g: int, q_offset: int, last_key: int
) -> torch.Tensor:
    """Softmax attention of rows [Hkv, B, D], rows r0.. of ``_chunked_attention``, over keys 0..last_key.

    Row r is at position q_offset + r // g. keys [Hkv, D, >= n], values [Hkv, >= n, D + 1] with a
    ones column last, n = keys 0..last_key rounded up to whole chunks. The max of a row is exact in
    any order, and every other reduction is fixed by the grid: each chunk is its own K=64 matmul and
    the chunk results are added in chunk order. A chunk in a row's future adds exactly 0 to it.
    """
    hkv, b, _ = rows.shape
    n_chunks = last_key // KEY_CHUNK + 1
    n = n_chunks * KEY_CHUNK
    scores = torch.bmm(rows, keys[:, :, :n])
    if n - 1 > q_offset + r0 // g:  # some key loaded is in the future of some row
        positions = q_offset + torch.arange(r0, r0 + b, device=rows.device) // g
        future = torch.arange(n, device=rows.device) > positions[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    # The max only stabilises exp; the result does not depend on it, so it carries no gradient.
    # Every row sees key 0, so it is finite.
    probs = torch.exp(scores - scores.detach().amax(-1, keepdim=True))
    # partial[:, c] = probs of chunk c @ [v | 1] of chunk c: [Hkv, n_chunks, B, D + 1]
    chunked = probs.view(hkv, b, n_chunks, KEY_CHUNK).transpose(1, 2)
    partial = torch.matmul(chunked, values[:, :n].unflatten(1, (n_chunks, KEY_CHUNK)))
    acc, *later = partial.unbind(1)
    for chunk in later:
        acc = acc + chunk
    return acc[..., :-1] / acc[..., -1:]


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], *, scale: float, invariant: bool
) -> torch.Tensor:
    """One decode token for each of S sequences at once; q [S, Hq, D], k/v [S, N, Hkv, D] -> [S, Hq, D].

    o[s] = attention(q[s][None], k[s], v[s], q_offset=positions[s])[0]: sequence s's token sits at
    ``positions[s]`` and sees its keys 0..positions[s]; rows past that (padding, N >= every
    positions[s] + 1) must be finite. In invariant mode every bit equals ``attention`` called per
    sequence: the same padded GQA row groups, the same per-column score products on the same key grid
    (a column's bits do not depend on how many columns or batches share the matmul), the same exact
    max, and the same chunk-ordered sums (chunks past a sequence's end add exactly zero).
    """
    s, hq, d = q.shape
    _, n, hkv, _ = k.shape
    g = hq // hkv
    if not invariant:
        keys = torch.arange(n, device=q.device)
        visible = keys <= torch.tensor(positions, device=q.device)[:, None]  # [S, N]
        o = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=visible[:, None, None], scale=scale, enable_gqa=True)
        return o[:, :, 0]
    if n % KEY_CHUNK:
        raise ValueError(f"decode_attention: N={n} keys must be whole chunks of {KEY_CHUNK}")
    wide = _wide(q.dtype)
    rows = _pad_rows((q.to(wide) * scale).reshape(s * hkv, g, d), ROW_MULTIPLE)  # [S*Hkv, >=4, D]
    keys = k.to(wide).permute(0, 2, 3, 1).reshape(s * hkv, d, n)
    values = F.pad(v.to(wide).transpose(1, 2), (0, 1), value=1.0).reshape(s * hkv, n, d + 1)
    scores = torch.bmm(rows, keys)
    pos = torch.tensor(positions, device=q.device).repeat_interleave(hkv)
    scores = scores.masked_fill((torch.arange(n, device=q.device) > pos[:, None])[:, None], float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    b = rows.shape[1]
    chunked = probs.view(s * hkv, b, n // KEY_CHUNK, KEY_CHUNK).transpose(1, 2)
    partial = torch.matmul(chunked, values.unflatten(1, (n // KEY_CHUNK, KEY_CHUNK)))
    acc, *later = partial.unbind(1)
    for chunk in later:
        acc = acc + chunk
    out = (acc[..., :-1] / acc[..., -1:])[:, :g]
    return out.reshape(s, hq, d).to(q.dtype)
