"""The sampler's KV block manager: which physical blocks of a ``kv.KVPool`` are free, held or cached.

Pure bookkeeping (no tensors; the scheduler thread's alone). A block is ``BLOCK`` (= ``KEY_CHUNK``) token
rows of every layer. Block 0 is the null block: never handed out, always zeros, it pads block tables.

    ref[b]          how many sequences hold block b (a forked sample shares its prompt's full blocks)
    free            blocks held by nobody and holding nothing worth keeping
    cached          blocks held by nobody but full and hashed, least recently released first: reusable
                    by a later prompt with the same prefix until ``allocate`` evicts them for room
    by_hash[h]      the block holding the full block whose chain digest is h

A full block's digest chains its predecessor's: ``digest(parent, tokens) = blake2b(parent || tokens)``,
with the root ``parent`` a ``seed`` naming everything else the keys depend on (tenant, base model,
adapter and its version), so equal digests mean the same tokens after the same prefix under the same
weights. The tokens are kept with the block and compared on a hit as well.

Counters: ``hits`` / ``misses`` count the full prompt blocks ``match`` found cached or not.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from lathe.kernels.attention import KEY_CHUNK

BLOCK = KEY_CHUNK
"""Token rows per block: the invariant attention's key chunk, so a block is a chunk of the key grid."""

NULL = 0
"""The all-zero block that pads every block table."""


def root_digest(*parts: str) -> bytes:
    """The chain's seed for sequences whose keys depend on ``parts`` (e.g. tenant, model, adapter, version)."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The digest of a full block of ``tokens`` following the block whose digest is ``parent``."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def blocks_for(tokens: int) -> int:
    """Blocks that hold ``tokens`` rows."""
    return -(-tokens // BLOCK)


@dataclass(slots=True)
class _Cached:
    digest: bytes
    tokens: tuple[int, ...]


class BlockManager:
    """Reference counts, the free list and the LRU cache of full blocks over ``num_blocks`` blocks
    (block 0 is the null block, so ``num_blocks - 1`` are usable)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.by_hash: dict[bytes, int] = {}
        self.full: dict[int, _Cached] = {}  # hashed blocks, held or cached
        self.hits = self.misses = 0

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks ``allocate`` can hand out now: free ones and cached ones (evicted on demand)."""
        return len(self.free) + len(self.cached)

    def allocate(self) -> int:
        """A block for one holder; evicts the least recently released cached block when none is free.
        The caller clears its rows."""
        if self.free:
            b = self.free.pop()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)
            del self.by_hash[self.full.pop(b).digest]
        else:
            raise RuntimeError(f"KV pool exhausted: all {self.usable} blocks are held (admission let too much in)")
        self.ref[b] = 1
        return b

    def acquire(self, b: int) -> None:
        """One more holder of block ``b`` (a fork, or a prompt reusing a cached block)."""
        if self.ref[b] == 0:
            del self.cached[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One holder less; a block nobody holds is cached if it is full and hashed, else freed."""
        if self.ref[b] < 1:
            raise RuntimeError(f"block {b} released more often than held")
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.full:
                self.cached[b] = None
            else:
                self.free.append(b)

    def register(self, b: int, digest: bytes, tokens: list[int]) -> None:
        """Record that held block ``b`` is full with ``tokens`` after the prefix ``digest`` names (a block
        whose digest is already known keeps the first one: both hold the same bits)."""
        if digest not in self.by_hash and b not in self.full:
            self.by_hash[digest] = b
            self.full[b] = _Cached(digest, tuple(tokens))

    def match(self, seed: bytes, tokens: list[int], limit: int) -> tuple[list[int], list[bytes]]:
        """Acquire the cached blocks that hold the longest prefix of ``tokens`` in whole blocks, at most
        ``limit`` tokens; returns them and their digests. Counts the full blocks up to ``limit`` as hits
        or misses."""
        blocks, digests, parent = [], [], seed
        wanted = min(limit, len(tokens)) // BLOCK
        for i in range(wanted):
            chunk = tokens[i * BLOCK:(i + 1) * BLOCK]
            parent = block_digest(parent, chunk)
            b = self.by_hash.get(parent)
            if b is None or self.full[b].tokens != tuple(chunk):
                break
            blocks.append(b)
            digests.append(parent)
        for b in blocks:
            self.acquire(b)
        self.hits += len(blocks)
        self.misses += wanted - len(blocks)
        return blocks, digests


def blocks_needed(prompt: int, max_tokens: int, samples: int) -> int:
    """The most blocks a request's sequences hold together: the prompt's full blocks once (its samples
    share them), and per sample the rest of its ``prompt + max_tokens`` rows (a partial prompt block is
    copied into each)."""
    shared = prompt // BLOCK
    return shared + samples * (blocks_for(prompt + max_tokens) - shared)
