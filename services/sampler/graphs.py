"""Padded decode steps and their CUDA graphs: one base model's pure decode steps at bucket batch sizes.

A pure decode step feeds one token to each of n running sequences (no prompt rows). ``DecodeRunner``
runs it at a fixed shape (B, C) (``GraphConfig.shape``): the batch padded to the next bucket B (1, 2,
4, ..., 64 by default; beyond the largest, B = n) and the block tables to the next power of two C of
blocks. Every input the forward reads is a device tensor of that shape, filled by ONE host-to-device
copy per step (``_Inputs``):

    tokens [B], positions [B]   the fed token and its position; padding rows: token 0 at position 0
    rows [B]                    the flat KV-pool row the token's key and value go to; padding rows: the
                                pool's sink block (written, never read)
    grid [B, C]                 block tables padded with NULL (block 0, all zeros); padding rows: all NULL
    idx [B]                     the adapter slot of each row (slot path); -1, no adapter, for base-model
                                rows and padding rows

The forward is ``Decoder.hidden`` over a ``kv.DecodeKV``, then every row's logits [B, V] fp32 and
logprobs ``log_softmax(logits)``; the first n rows come back to the CPU, the padding rows are dropped,
and each cache advances by its token (as ``StepKV.commit``). Under the batch-invariant ops a real row's
bits do not depend on the padding: padded and unpadded decodes give the same logprob bits.

LoRA layout: with a ``SlotPool`` (the throughput path, ``SamplerConfig.bgmv``) a ``SlotBatch`` over the
static ``idx``; without one, the per-segment ``LoraBatch`` of the rows grouped by adapter (padding rows a
base-model segment), built per step. A CUDA graph per (B, C) is captured on first use when the model is
on CUDA, ``GraphConfig.capture`` is on, B is a bucket and the layout is static (a slot pool, or no
adapter in the step); every other step runs the same code eagerly. The graphs share one memory pool and
one pair of output buffers per B, and are captured and replayed on the scheduler thread only.

Owns: the captured graphs and their static buffers, on the model's device. Never owns the KV pool, the
slot pool or the caches (the engine's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.kernels import ops
from lathe.models.decoder import Decoder, Packed
from lathe.models.lora import LoraDeltas, LoraWeights
from lathe.sampler.blocks import BLOCK, NULL, blocks_for
from lathe.sampler.kv import DecodeKV, KVPool
from lathe.sampler.slots import SlotBatch, SlotPool
from lathe.sampler.step import Item, ItemOut, adapter_order, segments

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class GraphConfig:
    buckets: tuple[int, ...] = BUCKETS  # batch sizes decode steps are padded to (and captured at)
    capture: bool = True  # capture CUDA graphs where the model is on CUDA; False: padded steps run eagerly

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"graph buckets must be increasing positive batch sizes, got {self.buckets}")

    def shape(self, rows: int, blocks: int) -> tuple[int, int]:
        """(B, C) for ``rows`` sequences whose tables need at most ``blocks`` blocks: the smallest bucket
        >= rows (``rows`` itself beyond the largest) and the smallest power of two >= blocks."""
        return next((b for b in self.buckets if b >= rows), rows), 1 << max(0, blocks - 1).bit_length()


class _Inputs:
    """The static inputs of one shape (B, C): one int64 device tensor ``flat`` and its views."""

    def __init__(self, b: int, c: int, device: torch.device) -> None:
        self.flat = torch.zeros(b * (4 + c), dtype=torch.long, device=device)
        self.tokens, self.positions, self.rows, self.idx = self.flat[:4 * b].view(4, b)
        self.grid = self.flat[4 * b:].view(b, c)
        self.cu = list(range(b + 1))


def _host_inputs(items: list[Item], idx: list[int] | None, b: int, c: int, sink_row: int) -> torch.Tensor:
    """``_Inputs.flat`` of ``items`` (caches reserved for their token) padded to (b, c), on the CPU."""
    pad = b - len(items)
    positions = [it.cache.length for it in items]
    rows = [it.cache.table[p // BLOCK] * BLOCK + p % BLOCK for it, p in zip(items, positions, strict=True)]
    grid: list[int] = []
    for it, p in zip(items, positions, strict=True):
        table = it.cache.table[:blocks_for(p + 1)]
        grid += table + [NULL] * (c - len(table))
    slots = idx if idx is not None else [-1] * len(items)
    return torch.tensor([it.tokens[0] for it in items] + [0] * pad + positions + [0] * pad
                        + rows + [sink_row] * pad + slots + [-1] * pad + grid + [NULL] * (c * pad),
                        dtype=torch.long)


class DecodeRunner:
    """Pure decode steps of one base model at padded shapes, replayed from CUDA graphs where it can."""

    def __init__(self, model: Decoder, kv: KVPool, slots: SlotPool | None, cfg: GraphConfig) -> None:
        self.model, self.kv, self.slots, self.cfg = model, kv, slots, cfg
        self.capture = cfg.capture and model.device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, _Inputs]] = {}
        self._outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mempool: tuple[int, int] | None = None
        self.replays = 0  # steps served by a captured graph

    @torch.inference_mode()
    def run(self, items: list[Item], idx: list[int] | None = None) -> list[ItemOut]:
        """Feed each item's one token; outputs (logits and logprobs only) in the order of ``items``.
        ``idx``: each item's adapter slot in the slot pool (-1: base model); given iff there is a pool."""
        if not items or any(len(it.tokens) != 1 or it.ask is not None for it in items):
            raise ValueError("a decode step feeds exactly one token to each of its sequences and asks nothing")
        if (idx is None) != (self.slots is None) or (idx is not None and len(idx) != len(items)):
            raise ValueError("idx gives one slot per item exactly when the runner has a slot pool")
        order = list(range(len(items))) if self.slots is not None else adapter_order(items)
        packed = [items[i] for i in order]
        for it in packed:
            it.cache.reserve(it.cache.length + 1)
        b, c = self.cfg.shape(len(packed), max(blocks_for(it.cache.length + 1) for it in packed))
        host = _host_inputs(packed, idx, b, c, self.kv.sink_row())
        adapters = [it.adapter for it in packed] + [None] * (b - len(packed))
        if self.capture and b in self.cfg.buckets and (self.slots is not None or all(a is None for a in adapters)):
            graph, inputs = self._graph(b, c)
            inputs.flat.copy_(host)
            graph.replay()
            logits, logprobs = self._outs[b]
            self.replays += 1
        else:
            inputs = _Inputs(b, c, self.model.device)
            inputs.flat.copy_(host)
            logits, logprobs = self._forward(inputs, self._lora(inputs, adapters))
        n = len(packed)
        logits, logprobs = logits[:n].cpu(), logprobs[:n].cpu()
        for it in packed:
            it.cache.advance(list(it.tokens))
        outs = {i: ItemOut(logits[s], logprobs[s]) for s, i in enumerate(order)}
        return [outs[i] for i in range(len(items))]

    def _lora(self, inputs: _Inputs, adapters: list[LoraWeights | None]) -> LoraDeltas | None:
        if self.slots is not None:
            return SlotBatch(self.slots, inputs.idx)
        return segments(adapters, [1] * len(adapters), self.model)

    def _forward(self, inputs: _Inputs, lora: LoraDeltas | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] and logprobs [B, V] of every row, the new keys and values written to the pool."""
        kv = DecodeKV(self.kv, inputs.rows, inputs.grid, inputs.positions)
        h = self.model.hidden(Packed(inputs.tokens, inputs.positions, inputs.cu), lora, kv)
        logits = self.model.logits(h, lora)
        return logits, ops.log_softmax(logits, dim=-1, invariant=self.model.invariant)

    def _graph(self, b: int, c: int) -> tuple[torch.cuda.CUDAGraph, _Inputs]:
        """The graph of shape (b, c) and its inputs, captured on first use (after one warm-up run on a side
        stream, which compiles kernels and sets up library workspaces outside the capture)."""
        if (b, c) in self._graphs:
            return self._graphs[(b, c)]
        inputs = _Inputs(b, c, self.model.device)
        inputs.rows.fill_(self.kv.sink_row())  # the warm-up and the capture write the sink only
        lora = self._lora(inputs, [None] * b)
        if b not in self._outs:
            wide = torch.promote_types(self.model.dtype, torch.float32)
            shape = (b, self.model.cfg.vocab_size)
            self._outs[b] = (torch.empty(shape, dtype=wide, device=self.model.device),
                             torch.empty(shape, dtype=wide, device=self.model.device))
        out_logits, out_logprobs = self._outs[b]

        def step() -> None:
            logits, logprobs = self._forward(inputs, lora)
            out_logits.copy_(logits)
            out_logprobs.copy_(logprobs)

        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            step()
        self._graphs[(b, c)] = (graph, inputs)
        return graph, inputs
