"""The sampler's KV cache: one growable buffer pair per sequence and layer, and a per-step view.

    SeqCache                   one sequence's keys and values
      k[layer], v[layer]: [capacity, Hkv, D] in the model dtype, on the model's device; rows [0, length)
      hold the tokens fed so far, rows [length, capacity) are zeros (the invariant attention reads fixed
      key chunks)
      capacity grows in whole blocks of ``BLOCK`` rows

    StepKV(caches, new)        the decoder's ``KVCache`` for one packed step
      extend(layer, s, k [L, Hkv, D], v) writes rows [length, length + L) of caches[s] and returns
      (k_all [length + L, Hkv, D], v_all, length); ``commit()`` then advances every length by its L
      stacked(layer) -> every sequence's keys and values as [S, N, Hkv, D] (zero-padded), for decode

A request's prompt is prefilled once into one ``SeqCache``; ``fork()`` copies it for every further
sample, so ``num_samples`` sequences share one prefill.
"""

from __future__ import annotations

import torch

from lathe.kernels.ops import KEY_CHUNK

BLOCK = KEY_CHUNK
"""Capacity grows in multiples of this many tokens (the attention key grid, so a block is a chunk)."""


class SeqCache:
    """Keys and values of one sequence in every layer; ``length`` tokens are filled."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.k: list[torch.Tensor] = [self._zeros(0) for _ in range(layers)]
        self.v: list[torch.Tensor] = [self._zeros(0) for _ in range(layers)]
        self.length = 0

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, *self.shape, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` tokens in total: grow to the next multiple of ``BLOCK``."""
        if tokens <= self.capacity:
            return
        cap = -(-tokens // BLOCK) * BLOCK
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                new = self._zeros(cap)
                new[: self.length] = old[: self.length]
                bufs[i] = new

    def fork(self) -> SeqCache:
        """An independent copy (same length, same bits, same capacity)."""
        twin = SeqCache.__new__(SeqCache)
        twin.shape, twin.dtype, twin.device, twin.length = self.shape, self.dtype, self.device, self.length
        twin.k = [t.clone() for t in self.k]
        twin.v = [t.clone() for t in self.v]
        return twin


class StepKV:
    """The ``KVCache`` the decoder sees for one packed step: packed sequence ``s`` is ``caches[s]``,
    receiving ``new[s]`` tokens in every layer."""

    def __init__(self, caches: list[SeqCache], new: list[int]) -> None:
        if len(caches) != len(new):
            raise ValueError("one new-token count per cache")
        self.caches, self.new = caches, new
        for c, n in zip(caches, new, strict=True):
            c.reserve(c.length + n)

    def extend(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        c = self.caches[seq]
        start, end = c.length, c.length + k.shape[0]
        if k.shape[0] != self.new[seq]:
            raise ValueError(f"sequence {seq} announced {self.new[seq]} new tokens, layer {layer} gave {k.shape[0]}")
        c.k[layer][start:end] = k
        c.v[layer][start:end] = v
        return c.k[layer][:end], c.v[layer][:end], start

    def stacked(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every sequence after this step's ``extend``, padded with zero rows to one
        whole number of key chunks: ``[S, N, Hkv, D]`` each (for batched decode attention)."""
        n = max(-(-(c.length + k) // BLOCK) * BLOCK for c, k in zip(self.caches, self.new, strict=True))

        def rows(t: torch.Tensor) -> torch.Tensor:
            t = t[:n]
            return t if t.shape[0] == n else torch.nn.functional.pad(t, (0, 0, 0, 0, 0, n - t.shape[0]))

        return (torch.stack([rows(c.k[layer]) for c in self.caches]),
                torch.stack([rows(c.v[layer]) for c in self.caches]))

    def commit(self) -> None:
        """Advance every sequence past the tokens of this step (call once, after the forward)."""
        for c, n in zip(self.caches, self.new, strict=True):
            c.length += n
