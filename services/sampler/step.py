"""One scheduler step of one base model: ONE packed forward over prefills and decode tokens.

    items[i]: tokens fed now (a prompt, or what of it its cache does not hold yet, for a prefill; the last
              sampled token for a decode), its SeqCache (holding ``cache.length`` earlier tokens: a reused
              prefix of the prompt, or the sequence so far), its adapter (None: base model)

The items are packed adapter by adapter (each adapter one LoRA segment), token ``j`` of item ``i`` at
absolute position ``cache.length + j``, and the decoder runs once over all of them with a ``StepKV``
over their caches. Then, per item (back in the caller's order):

    logits   [V] fp32   logits of its last row (what the next token is drawn from)
    logprobs [V] fp32   log_softmax(logits): the policy's logprobs at temperature 1
    and for a prefill whose ``PromptAsk`` asked for them, from its prompt rows (row j predicts
    prompt[j + 1], lp[j] = log_softmax(logits[j]), s = ask.scored_from; a reused prefix must end at or
    before ``ask.first_row()``, the rows before it are not computed):
    prompt_logprobs [L-1]               lp[j][prompt[j + 1]] for j >= s, NaN before s
    topk_ids, topk_logprobs [L-1-s, k]  the k largest entries of lp[s:], descending
    target_logprobs [L-1, K]            lp[j][targets[j, c]], 0.0 where targets[j, c] == -1
    alt_tokens, alt_logprobs [L-1, k]   sampling.draw(logits[0:L-1], temperature, k), lp[j][alt_tokens[j, c]]
Only the rows from the first one an option needs are computed, ``LOGIT_CHUNK`` rows at a time.

Every op is the decoder's own (``Decoder.logits`` + ``ops.log_softmax``, the trainer's path in
``Decoder.target_logprobs``); with a batch-invariant decoder each number has the bits the trainer
computes for the same token, whatever else is packed into the step. The forward runs on the model's
device; the outputs come back on the CPU (one copy per step), where tokens are drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.kernels import ops
from lathe.models.decoder import LOGIT_CHUNK, Decoder, ExpertLoad, Packed
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.lora_batch import LoraBatch, lora_batch
from lathe.models.lora_sgmv import SgmvBatch
from lathe.sampler.kv import SeqCache, StepKV
from lathe.sampler.sampling import draw, generator

NO_ADAPTER = LoraWeights(LoraSpec(), {}, {})
"""Stands for the base model in a step that mixes it with adapters (it has no LoRA targets)."""


@dataclass(frozen=True, slots=True)
class PromptAsk:
    """What a prefill asks of its prompt rows (already checked against the prompt and the vocabulary)."""

    logprobs: bool = False  # prompt_logprobs
    topk: int = 0  # topk_prompt_logprobs
    scored_from: int = 0  # first row of logprobs and top-k (prompt_logprobs_last_n)
    targets: torch.Tensor | None = None  # target_prompt_logprobs: [L-1, K] int64 ids, -1 for none
    alt_k: int = 0  # prompt_alt_tokens_k
    alt_temperature: float = 1.0
    alt_seed: int = 0

    def first_row(self) -> int:
        """The first prompt row any asked option needs."""
        rows = []
        if self.logprobs or self.topk:
            rows.append(self.scored_from)
        if self.targets is not None:
            rows.append(int((self.targets >= 0).any(dim=1).int().argmax()))
        if self.alt_k:
            rows.append(0)
        return min(rows)


@dataclass(slots=True)
class Item:
    tokens: list[int]
    cache: SeqCache
    adapter: LoraWeights | None
    ask: PromptAsk | None = None  # a prefill's prompt options; None: nothing asked (or a decode)


@dataclass(slots=True)
class ItemOut:
    logits: torch.Tensor
    logprobs: torch.Tensor
    prompt_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    target_logprobs: torch.Tensor | None = None
    alt_tokens: torch.Tensor | None = None
    alt_logprobs: torch.Tensor | None = None


def adapter_order(items: list[Item]) -> list[int]:
    """Indices of ``items`` grouped adapter by adapter (groups in order of first appearance, items in order
    within a group): the packing order, in which each adapter is one LoRA segment."""
    groups: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(id(it.adapter), []).append(i)
    return [i for members in groups.values() for i in members]


def segments(adapters: list[LoraWeights | None], counts: list[int], model: Decoder) -> LoraBatch | SgmvBatch | None:
    """The LoRA batch (the pool's backend) of rows laid out as ``counts[i]`` rows of ``adapters[i]`` (already
    grouped)."""
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
    return lora_batch(seg, ids, table, invariant=model.invariant, sgmv=model.sgmv)


def _cat(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts).cpu() if parts else empty


def _prompt_rows(model: Decoder, h: torch.Tensor, item: Item, out: ItemOut) -> None:
    """The prompt options of one prefilled item from its hidden rows ``h [L, hidden]``."""
    ask = item.ask
    assert ask is not None
    prompt = item.cache.tokens  # after the step's commit: the whole prompt
    offset = len(prompt) - len(item.tokens)  # rows of a reused prefix, not in h
    rows = len(prompt) - 1
    start, s = ask.first_row(), ask.scored_from
    if start < offset:
        raise ValueError(f"prompt rows from {start} were asked for, but the first {offset} came from the cache")
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=h.device)
    wanted = ask.targets.to(h.device) if ask.targets is not None else None
    gen = generator(ask.alt_seed, 0, stream="prompt-alt") if ask.alt_k else None
    lps, ids, tops, cells, alts, alt_lps = [], [], [], [], [], []
    for r0 in range(start, rows, LOGIT_CHUNK):
        r1 = min(r0 + LOGIT_CHUNK, rows)
        logits = model.logits(h[r0 - offset:r1 - offset], segments([item.adapter], [r1 - r0], model))
        lp = ops.log_softmax(logits, dim=-1, invariant=model.invariant)
        scored = lp[max(s - r0, 0):]
        if ask.logprobs and len(scored):
            lps.append(scored.gather(1, targets[max(s, r0):r1, None]).squeeze(1))
        if ask.topk and len(scored):
            top = torch.topk(scored, ask.topk, dim=-1)
            tops.append(top.values)
            ids.append(top.indices)
        if wanted is not None:
            w = wanted[r0:r1]
            cells.append(lp.gather(1, w.clamp(min=0)).masked_fill(w < 0, 0.0))
        if gen is not None:
            drawn = draw(logits.cpu(), ask.alt_temperature, ask.alt_k, gen)
            alts.append(drawn)
            alt_lps.append(lp.gather(1, drawn.to(lp.device)))
    if ask.logprobs:
        out.prompt_logprobs = torch.cat([torch.full((s,), float("nan")), _cat(lps, torch.zeros(0))])
    if ask.topk:
        out.topk_logprobs = _cat(tops, torch.zeros(0, ask.topk))
        out.topk_ids = _cat(ids, torch.zeros(0, ask.topk, dtype=torch.long))
    if ask.targets is not None:
        k = ask.targets.shape[1]
        out.target_logprobs = torch.cat([torch.zeros(start, k), _cat(cells, torch.zeros(0, k))])
    if ask.alt_k:
        out.alt_tokens = _cat(alts, torch.zeros(0, ask.alt_k, dtype=torch.long))
        out.alt_logprobs = _cat(alt_lps, torch.zeros(0, ask.alt_k))


@torch.inference_mode()
def run_step(model: Decoder, items: list[Item], load: ExpertLoad | None = None) -> list[ItemOut]:
    """Feed every item's tokens through ``model`` at once; outputs in the order of ``items``. ``load``, where
    given, receives the routing of the step's sparse layers (``Decoder.hidden``)."""
    if not items:
        return []
    order = adapter_order(items)
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
    kv = StepKV([it.cache for it in packed_items], [it.tokens for it in packed_items])
    h = model.hidden(batch, segments(adapters, lengths, model), kv, load)
    kv.commit()
    last = h[[c - 1 for c in cu[1:]]]
    logits = model.logits(last, segments(adapters, [1] * len(adapters), model))
    logprobs = ops.log_softmax(logits, dim=-1, invariant=model.invariant)
    logits, logprobs = logits.cpu(), logprobs.cpu()
    outs: dict[int, ItemOut] = {}
    for s, i in enumerate(order):
        out = outs[i] = ItemOut(logits[s], logprobs[s])
        if items[i].ask is not None:
            _prompt_rows(model, h[cu[s]:cu[s + 1]], items[i], out)
    return [outs[i] for i in range(len(items))]
