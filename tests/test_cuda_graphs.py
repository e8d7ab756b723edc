"""Padded decode steps (``lathe.sampler.graphs``) and their CUDA graphs.

Protects: bucket shapes (batch to the next bucket, eager size beyond the largest; block tables to the next
power of two); a decode step padded to its bucket, through the runner's padding and unpadding code run
eagerly, gives logits and logprobs with the bits of the unpadded ``run_step`` decode under the invariant
ops, over adapters of different ranks and the base model, sequences of different lengths crossing a block
boundary, for several steps, leaving the same keys and values in the caches and block 0 all zeros (padding
rows write the sink); the runner refuses a step that is not a pure decode. Marked ``gpu`` (skipped without
CUDA): the same step replayed from a captured CUDA graph has the bits of the same runner run eagerly, with
the invariant ops and with the slot pool's Triton BGMV, and replays again after the inputs change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lathe.kernels.sgmv_triton import triton_available
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.sampler.blocks import BLOCK, NULL, blocks_for
from lathe.sampler.graphs import DecodeRunner, GraphConfig
from lathe.sampler.kv import KVPool, SeqCache
from lathe.sampler.slots import SlotPool
from lathe.sampler.step import Item, ItemOut, run_step

torch.set_num_threads(1)


def adapter(model: Decoder, rank: int, seed: int, **targets: bool) -> LoraWeights:
    w = LoraWeights.init(model.cfg, LoraSpec(rank=rank, **targets), seed, model.device)
    gen = torch.Generator().manual_seed(seed + 1)
    b = {k: (torch.randn(t.shape, generator=gen) * 0.05).to(model.device) for k, t in w.b.items()}
    return LoraWeights(w.spec, {k: t.detach() for k, t in w.a.items()}, b)


def prefilled(model: Decoder, prompts: list[list[int]], owners: list[LoraWeights | None]
              ) -> tuple[KVPool, list[SeqCache], list[int]]:
    """A pool holding each prompt prefilled by ``run_step``, the caches and each one's first greedy token."""
    pool = KVPool.for_model(model, 64)
    caches = [pool.sequence(b"") for _ in prompts]
    outs = run_step(model, [Item(list(p), c, a) for p, c, a in zip(prompts, caches, owners, strict=True)])
    return pool, caches, [int(o.logits.argmax()) for o in outs]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.double().view(torch.int64)


def test_shapes_pad_to_buckets_and_powers_of_two() -> None:
    cfg = GraphConfig()
    assert [cfg.shape(n, 1)[0] for n in (1, 2, 3, 5, 9, 33, 64, 65)] == [1, 2, 4, 8, 16, 64, 64, 65]
    assert [cfg.shape(1, c)[1] for c in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="increasing positive batch sizes"):
        GraphConfig((4, 2))


def test_padded_decode_has_the_bits_of_the_unpadded_decode(tiny_dir: Path) -> None:
    model = Decoder.from_dir(tiny_dir)  # the invariant ops
    ws = [adapter(model, 2, 1), adapter(model, 8, 2, train_mlp=False)]
    owners = [ws[0], None, ws[1], ws[0], None]
    prompts = [list(range(3, 3 + n)) for n in (5, BLOCK - 2, 1, BLOCK + 9, 30)]
    ref_pool, ref_caches, ref_next = prefilled(model, prompts, owners)
    pool, caches, nxt = prefilled(model, prompts, owners)
    runner = DecodeRunner(model, pool, None, GraphConfig(capture=False))
    for step in range(4):  # sequence 1 crosses into its second block at step 2
        live = list(range(3 if step % 2 else 5))  # 5 rows pad to 8, 3 rows to 4
        want: list[ItemOut] = run_step(model, [Item([ref_next[i]], ref_caches[i], owners[i]) for i in live])
        got = runner.run([Item([nxt[i]], caches[i], owners[i]) for i in live])
        for i, w, g in zip(live, want, got, strict=True):
            assert torch.equal(bits(g.logits), bits(w.logits)) and torch.equal(bits(g.logprobs), bits(w.logprobs))
            ref_next[i] = nxt[i] = int(w.logits.argmax())
    for c, r in zip(caches, ref_caches, strict=True):
        assert c.length == r.length and c.tokens == r.tokens
        for layer in range(model.cfg.num_layers):
            rows = blocks_for(c.length)
            assert torch.equal(pool.k[layer][c.table[:rows]].flatten(0, 1)[:c.length],
                               ref_pool.k[layer][r.table[:rows]].flatten(0, 1)[:r.length])
    assert all(not t[NULL].any() for t in (*pool.k, *pool.v))  # padding rows wrote the sink, not block 0
    with pytest.raises(ValueError, match="exactly one token"):
        runner.run([Item([1, 2], caches[0], None)])


def _graph_vs_eager(model: Decoder, slots: SlotPool | None, owners: list[LoraWeights | None]) -> None:
    """Two decode steps replayed from graphs vs the same runner eager on a twin pool: the same bits."""
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 1)][:len(owners)]
    runs = []
    for capture in (True, False):
        pool, caches, nxt = prefilled(model, prompts, owners)
        runner = DecodeRunner(model, pool, slots, GraphConfig(capture=capture))
        outs = []
        for _ in range(2):
            idx = None
            if slots is not None:
                idx = slots.place([None if a is None else (id(a), a) for a in owners])
            step = runner.run([Item([t], c, a) for t, c, a in zip(nxt, caches, owners, strict=True)], idx)
            nxt = [int(o.logits.argmax()) for o in step]
            outs.append(step)
        assert runner.replays == (2 if capture else 0)
        runs.append(outs)
    for graphed, eager in zip(*runs, strict=True):
        for g, e in zip(graphed, eager, strict=True):
            assert torch.equal(bits(g.logits), bits(e.logits)) and torch.equal(bits(g.logprobs), bits(e.logprobs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_the_eager_bits_invariant(tiny_dir: Path, dtype: torch.dtype) -> None:
    model = Decoder.from_dir(tiny_dir, dtype=dtype, device="cuda")
    _graph_vs_eager(model, None, [None, None, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_cuda_graph_replays_the_eager_bits_with_slots(tiny_dir: Path, dtype: torch.dtype) -> None:
    model = Decoder.from_dir(tiny_dir, dtype=dtype, device="cuda", invariant=False)
    ws = [adapter(model, 2, 1), adapter(model, 8, 2, train_mlp=False)]
    slots = SlotPool(model.cfg, slots=4, rank_max=8, dtype=dtype, device="cuda", bgmv="triton")
    _graph_vs_eager(model, slots, [ws[0], None, ws[1]])
