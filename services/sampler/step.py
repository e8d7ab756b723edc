"""One scheduler step of one base model: ONE packed forward over prefills and decode tokens.

    items[i]: tokens fed now (a whole prompt for a prefill, the last sampled token for a decode),
              its SeqCache (holding ``cache.length`` earlier tokens), its adapter (None: base model)

The items are packed adapter by adapter (each adapter one LoRA segment), token ``j`` of item ``i`` at
absolute position ``cache.length + j``, and the decoder runs once over all of them with a ``StepKV``
over their caches. Then, per item (back in the caller's order):

    logits   [V] fp32   logits of its last row (what the next token is drawn from)
    logprobs [V] fp32   log_softmax(logits): the policy's logprobs at temperature 1
    and for a prefill that asked for them, from rows 0 .. L-2 of its prompt:
    prompt_logprobs [L-1]          log_softmax(logits[j])[prompt[j + 1]]
    topk_ids, topk_logprobs [L-1, k]   the k largest entries of each of those rows, descending

Every op is the decoder's own (``Decoder.logits`` + ``ops.log_softmax``, the trainer's path in
``Decoder.target_logprobs``); with a batch-invariant decoder each number has the bits the trainer
computes for the same token, whatever else is packed into the step. The forward runs on the model's
device; the outputs come back on the CPU (one copy per step), where tokens are drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.kernels import ops
from lathe.models.decoder import LOGIT_CHUNK, Decoder, Packed
from lathe.models.lora import LoraBatch, LoraSpec, LoraWeights
from lathe.sampler.kv import SeqCache, StepKV

NO_ADAPTER = LoraWeights(LoraSpec(), {}, {})
"""Stands for the base model in a step that mixes it with adapters (it has no LoRA targets)."""


@dataclass(slots=True)
class Item:
    tokens: list[int]
    cache: SeqCache
    adapter: LoraWeights | None
    prompt_logprobs: bool = False
    topk: int = 0


@dataclass(slots=True)
class ItemOut:
    logits: torch.Tensor
    logprobs: torch.Tensor
    prompt_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


def _segments(adapters: list[LoraWeights | None], counts: list[int], model: Decoder) -> LoraBatch | None:
    """The LoraBatch of rows laid out as ``counts[i]`` rows of ``adapters[i]`` (already grouped)."""
    if all(a is None for a in adapters):
        return None
    slots: dict[int, int] = {}
    table: list[LoraWeights] = []
    seg, ids = [0], []
    for a, c in zip(adapters, counts, strict=True):
        w = NO_ADAPTER if a is None else a
        if id(w) not in slots:
            slots[id(w)] = len(table)
            table.append(w)
        if ids and ids[-1] == slots[id(w)]:
            seg[-1] += c
        else:
            ids.append(slots[id(w)])
            seg.append(seg[-1] + c)
    return LoraBatch(seg, ids, table, invariant=model.invariant, triton=model.sgmv)


def _prompt_rows(model: Decoder, h: torch.Tensor, item: Item, out: ItemOut) -> None:
    """Prompt logprobs (and top-k) of one prefilled item from its hidden rows ``h [L, hidden]``."""
    targets = torch.tensor(item.tokens[1:], dtype=torch.long, device=h.device)
    rows = h.shape[0] - 1
    lps, ids, tops = [], [], []
    for r0 in range(0, rows, LOGIT_CHUNK):
        r1 = min(r0 + LOGIT_CHUNK, rows)
        lora = _segments([item.adapter], [r1 - r0], model)
        lp = ops.log_softmax(model.logits(h[r0:r1], lora), dim=-1, invariant=model.invariant)
        if item.prompt_logprobs:
            lps.append(lp.gather(1, targets[r0:r1, None]).squeeze(1))
        if item.topk:
            top = torch.topk(lp, item.topk, dim=-1)
            tops.append(top.values)
            ids.append(top.indices)
    if item.prompt_logprobs:
        out.prompt_logprobs = torch.cat(lps).cpu() if lps else torch.zeros(0)
    if item.topk:
        out.topk_logprobs = torch.cat(tops).cpu() if tops else torch.zeros(0, item.topk)
        out.topk_ids = torch.cat(ids).cpu() if ids else torch.zeros(0, item.topk, dtype=torch.long)


@torch.inference_mode()
def run_step(model: Decoder, items: list[Item]) -> list[ItemOut]:
    """Feed every item's tokens through ``model`` at once; outputs in the order of ``items``."""
    if not items:
        return []
    groups: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(id(it.adapter), []).append(i)
    order = [i for members in groups.values() for i in members]
    packed_items = [items[i] for i in order]
    lengths = [len(it.tokens) for it in packed_items]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    batch = Packed(
        tokens=torch.tensor([t for it in packed_items for t in it.tokens], dtype=torch.long),
        positions=torch.cat([torch.arange(it.cache.length, it.cache.length + n)
                             for it, n in zip(packed_items, lengths, strict=True)]),
        cu_seqlens=cu,
    )
    adapters = [it.adapter for it in packed_items]
    kv = StepKV([it.cache for it in packed_items], lengths)
    h = model.hidden(batch, _segments(adapters, lengths, model), kv)
    kv.commit()
    last = h[[c - 1 for c in cu[1:]]]
    logits = model.logits(last, _segments(adapters, [1] * len(adapters), model))
    logprobs = ops.log_softmax(logits, dim=-1, invariant=model.invariant)
    logits, logprobs = logits.cpu(), logprobs.cpu()
    outs: dict[int, ItemOut] = {}
    for s, i in enumerate(order):
        out = outs[i] = ItemOut(logits[s], logprobs[s])
        if items[i].prompt_logprobs or items[i].topk:
            _prompt_rows(model, h[cu[s]:cu[s + 1]], items[i], out)
    return [outs[i] for i in range(len(items))]
