"""The sampler's paged KV cache: block manager, block tables, prefix reuse and block admission.

Protects: reference counts, the free list and LRU eviction of cached full blocks; the chain digest (a
block matches only after the same prefix under the same seed, and its tokens are compared); a sequence's
gathered blocks present exactly the rows a contiguous buffer held, zeros past its length; a fork shares
full blocks and copies only a partial last one; a prompt that shares full blocks with an earlier one
reuses them (hit counter) and samples the same tokens with the same logprob bits as recomputing, prompt
logprobs included; an adapter's blocks are never reused for another adapter or the base model; a
request that cannot get blocks waits, one that never could is refused with a message naming the blocks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lathe.sampler.blocks import BLOCK, NULL, BlockManager, block_digest, blocks_needed, root_digest
from lathe.sampler.engine import SamplerEngine
from lathe.sampler.kv import KVPool, StepKV
from tests.test_sampler import make_engine, ok, pump, request, source_for

torch.set_num_threads(1)
SEED = root_digest("tenant", "model", "", "0")


@pytest.fixture()
def engines(model_cache: Path) -> Iterator[Callable[..., SamplerEngine]]:
    """Engines that are not started (driven by ``pump``), stopped after the test."""
    made: list[SamplerEngine] = []

    def make(source: object = None, **cfg: object) -> SamplerEngine:
        made.append(make_engine(model_cache, source, **cfg))
        return made[-1]

    yield make
    for eng in made:
        eng.stop()


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def bits(xs: object) -> list[int]:
    """The float64 bit patterns of ``xs`` (NaN compares equal to the same NaN)."""
    return torch.tensor(list(xs), dtype=torch.float64).view(torch.int64).tolist()


# ---------------------------------------------------------------- block manager


def test_blocks_are_refcounted_cached_when_full_and_evicted_lru() -> None:
    m = BlockManager(4)  # 3 usable
    a, b, c = m.allocate(), m.allocate(), m.allocate()
    assert NULL not in (a, b, c) and m.available == 0
    with pytest.raises(RuntimeError, match="all 3 blocks are held"):
        m.allocate()
    da = block_digest(SEED, tokens(BLOCK, 1))
    db = block_digest(da, tokens(BLOCK, 2))
    m.register(a, da, tokens(BLOCK, 1))
    m.register(b, db, tokens(BLOCK, 2))
    m.acquire(a)  # a second holder (a fork)
    for blk in (a, b, c):
        m.release(blk)
    assert m.ref[a] == 1 and list(m.cached) == [b] and m.free == [c]
    m.release(a)
    assert list(m.cached) == [b, a]  # least recently released first
    assert m.allocate() == c  # free blocks go before cached ones
    assert m.allocate() == b and db not in m.by_hash  # then the LRU cached block, forgotten
    with pytest.raises(RuntimeError, match="released more often than held"):
        m.release(c)
        m.release(c)


def test_match_follows_the_chain_and_compares_tokens() -> None:
    m = BlockManager(8)
    prompt = tokens(3 * BLOCK + 5)
    parent, held = SEED, []
    for i in range(3):
        chunk = prompt[i * BLOCK:(i + 1) * BLOCK]
        parent = block_digest(parent, chunk)
        held.append(m.allocate())
        m.register(held[-1], parent, chunk)
    found, _ = m.match(SEED, prompt, limit=len(prompt) - 1)
    assert found == held and (m.hits, m.misses) == (3, 0) and all(m.ref[b] == 2 for b in held)
    assert m.match(SEED, prompt, limit=2 * BLOCK)[0] == held[:2]  # never past the limit
    changed = prompt[:BLOCK] + [prompt[BLOCK] + 1] + prompt[BLOCK + 1:]
    assert m.match(SEED, changed, limit=len(prompt))[0] == held[:1]  # a change ends the chain there
    assert m.match(root_digest("tenant", "model", "adapter", "1"), prompt, limit=len(prompt))[0] == []
    m.full[held[0]].tokens = (0,) * BLOCK  # a digest collision is caught by the token compare
    assert m.match(SEED, prompt, limit=len(prompt))[0] == []


def test_blocks_needed_counts_shared_prompt_blocks_once() -> None:
    assert blocks_needed(2 * BLOCK + 3, 10, 4) == 2 + 4 * 1
    assert blocks_needed(BLOCK, BLOCK, 3) == 1 + 3 * 1
    assert blocks_needed(5, 200, 1) == -(-205 // BLOCK)


# ---------------------------------------------------------------- pool, tables, forks


def pool(blocks: int = 16) -> KVPool:
    return KVPool(layers=2, kv_heads=2, head_dim=4, num_blocks=blocks, dtype=torch.float32)


def test_tables_gather_the_rows_a_contiguous_buffer_held() -> None:
    p = pool()
    caches = [p.sequence(SEED), p.sequence(SEED)]
    lengths = [BLOCK + 7, 3]
    want = [torch.randn(n, 2, 4) for n in lengths]
    step = StepKV(caches, [tokens(n, i) for i, n in enumerate(lengths)])
    for layer in range(2):
        for s, w in enumerate(want):
            k, v, start = step.extend(layer, s, w * (layer + 1), -w)
            assert start == 0 and torch.equal(k, w * (layer + 1)) and torch.equal(v, -w)
    step.commit()
    assert [c.length for c in caches] == lengths and [len(c.table) for c in caches] == [2, 1]
    step = StepKV(caches, [[1], [2]])
    new = torch.randn(2, 2, 4)
    k_blocks, v_blocks, positions, table = step.decode(1, new, new + 1)
    step.commit()
    assert k_blocks is p.k[1] and v_blocks is p.v[1]  # the pool's own blocks, read in place
    ks, vs = p.gather(1, table)
    assert positions.tolist() == lengths and ks.shape == (2, 2 * BLOCK, 2, 4)
    for s, w in enumerate(want):
        n = lengths[s]
        assert torch.equal(ks[s, :n], w * 2) and torch.equal(ks[s, n], new[s]) and torch.equal(vs[s, n], new[s] + 1)
        assert not ks[s, n + 1:].any() and not vs[s, n + 1:].any()  # zeros past the end, null-block padding too


def test_fork_shares_full_blocks_copies_the_partial_one_and_release_frees() -> None:
    p = pool(8)
    c = p.sequence(SEED)
    step = StepKV([c], [tokens(BLOCK + 2)])
    rows = torch.randn(BLOCK + 2, 2, 4)
    for layer in range(2):
        step.extend(layer, 0, rows, rows)
    step.commit()
    twin = c.fork()
    assert twin.table[0] == c.table[0] and p.blocks.ref[c.table[0]] == 2 and twin.table[1] != c.table[1]
    step = StepKV([c, twin], [[7], [8]])
    step.decode(0, torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    step.decode(1, torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    step.commit()
    assert torch.equal(p.k[0][twin.table[1]][:2], rows[BLOCK:])  # the copy kept the prompt's bits
    assert (p.k[0][c.table[1]][2] == 1).all() and torch.equal(p.k[0][c.table[1]][:2], rows[BLOCK:])
    before = p.blocks.available
    c.release()
    twin.release()
    assert p.blocks.available == before + 3 and list(p.blocks.cached) == [c.table[0] if c.table else 1]
    fresh = p.sequence(SEED)
    fresh.reserve(1)
    assert not p.k[0][fresh.table[0]].any()  # a reused block is handed out cleared


# ---------------------------------------------------------------- through the engine


def _shared_prompt_requests() -> tuple[list[int], list[int]]:
    shared = tokens(2 * BLOCK + 10, 3)
    return shared + tokens(9, 4), shared + tokens(20, 5)


def test_prefix_reuse_is_bit_equal_to_recomputing(engines: Callable[..., SamplerEngine], tiny_dir: Path) -> None:
    first, second = _shared_prompt_requests()
    path = "tinker://run-a/sampler_weights/s1"
    outs = {}
    for cache in (True, False):
        eng = engines(source_for(tiny_dir), prefix_cache=cache)
        runs = []
        for prompt, extra, last_n in ((first, {}, 0), (second, {}, 0), (second, {"prompt_logprobs": True}, 0),
                                      (second, {"prompt_logprobs": True}, 5), (second, {"path": path}, 0)):
            req = request(prompt, n=3, max_tokens=BLOCK + 4, seed=9, **extra)
            if last_n:
                req.prompt_logprobs_last_n = last_n
            runs.append(ok(pump(eng, [eng.sample(req)])[0]))
        outs[cache] = (runs, eng.kv_stats())
    (cached, stats), (plain, plain_stats) = outs[True], outs[False]
    for a, b in zip(cached, plain, strict=True):
        assert [list(s.tokens) for s in a.sequences] == [list(s.tokens) for s in b.sequences]
        assert [list(s.logprobs) for s in a.sequences] == [list(s.logprobs) for s in b.sequences]  # bits equal
        assert bits(a.prompt_logprobs) == bits(b.prompt_logprobs)
    # the first prompt misses its 2 full blocks; the second hits them; with every prompt logprob asked nothing
    # may be reused (nothing looked up); with the last 5 asked they hit again; under an adapter the base
    # model's blocks are not its own: 2 misses
    assert (stats["prefix_hits"], stats["prefix_misses"]) == (4, 4)
    assert (plain_stats["prefix_hits"], plain_stats["prefix_misses"]) == (0, 0)


def test_requests_wait_for_blocks_and_one_that_never_fits_is_refused(
        engines: Callable[..., SamplerEngine]) -> None:
    eng = engines(kv_blocks=5)  # 4 usable
    res = pump(eng, [eng.sample(request(tokens(10), n=2, max_tokens=2 * BLOCK))])[0]
    assert res.error.code == "InvalidArgument" and "needs 6 KV blocks of 64 tokens" in res.error.message
    assert "has 4 (--kv-blocks)" in res.error.message
    futures = [eng.sample(request(tokens(10, i), n=2, max_tokens=BLOCK)) for i in range(2)]  # 4 blocks each
    while eng.stats()["waiting"] < 2:
        pass
    eng.step()
    assert eng.stats()["running"] == 2 and eng.stats()["waiting"] == 1  # the second waits for blocks
    results = pump(eng, futures)
    assert all(len(s.tokens) == BLOCK for r in results for s in ok(r).sequences)
    assert eng.kv_stats() == {"available": 4, "reserved": 0, "prefix_hits": 0, "prefix_misses": 0}
