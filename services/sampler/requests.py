"""One sample request as it flows through the native engine (``lathe.sampler.engine``), and its samples.

    Request   made by ``SamplerEngine.sample`` from the caller's ``pb.SampleRequest`` (kept as ``request`` only until
              the loader checks it into ``plan``); the loader gives it its base model and adapter, admission its
              reservation, its prefill its ``seqs`` (``start``), and ``SamplerEngine._finish`` its answer
              (``result``). Past the loader nothing reads protobuf but the answer's own builders.
    Seq       one of its samples while it decodes: its RNG, its KV cache (None once finished) and what it drew
              (``intake.Sampled``); ``advance`` draws its next token from its row of a step.

Who owns what: a request and its sequences belong to the engine's scheduler thread once admitted (before that, to
the loader thread that checks it); the engine's lock guards only the sets and counters they sit in. A request
never touches another request, the engine or the pools, but its own caches' blocks.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lathe.errors import LatheError
from lathe.models.lora import LoraWeights
from lathe.sampler.blocks import blocks_needed, root_digest
from lathe.sampler.intake import Ask, PromptScores, Sampled, answer, failure
from lathe.sampler.kv import KVPool, SeqCache
from lathe.sampler.sampling import choose, generator
from lathe.sampler.step import ItemOut
from lathe.sampler.validate import Plan
from lathe.types import Receipt
from lathe.v1 import lathe_pb2 as pb

if TYPE_CHECKING:
    from lathe.sampler.engine import Base


@dataclass(slots=True, eq=False)
class Request:
    ask: Ask
    request: pb.SampleRequest | None  # until the loader checks it into ``plan`` (intake), then None
    future: Future[pb.SampleResult]
    arrived: float
    base: Base | None = None
    plan: Plan | None = None
    adapter: LoraWeights | None = None
    admitted: float = 0.0
    reserved: int = 0  # tokens of the running budget held from admission until it finishes
    blocks: int = 0  # KV blocks of its base model's pool held from admission until it finishes
    step: int = 0
    seqs: list[Seq] = field(default_factory=list)
    unfinished: int = 0
    prompt: PromptScores | None = None  # what its prefill computed about the prompt, when asked

    def blocks_needed(self) -> int:
        """The KV blocks its sequences can hold at most (``blocks.blocks_needed``)."""
        return blocks_needed(len(self.plan.prompt), self.plan.max_tokens, self.plan.num_samples)

    def slot_key(self) -> tuple[str, str, str]:
        """What names its adapter's weights in a slot pool: tenant, path and the version pinned."""
        return self.ask.tenant, self.ask.model_path, repr(self.ask.model_version)

    def prompt_cache(self, kv: KVPool, prefix_cache: bool) -> SeqCache:
        """A new sequence in ``kv`` for its prompt, holding the cached blocks of its longest reusable prefix (none
        without ``prefix_cache``): at least the last prompt token is fed (its row gives the first token), and no
        prompt row an option asks for is skipped."""
        prompt = list(self.plan.prompt)
        reuse = len(prompt) - 1 if prefix_cache else 0
        if self.plan.ask is not None:
            reuse = min(reuse, self.plan.ask.first_row())
        seed = root_digest(self.ask.tenant, self.ask.base_model, self.ask.model_path, repr(self.ask.model_version))
        return kv.sequence(seed, prompt, reuse)

    def start(self, cache: SeqCache, out: ItemOut) -> bool:
        """After its prefill (``cache``, the step's ``out``): record the prompt options, draw each sample's first
        token and fork the cache to the samples still running. True if every sample has finished already."""
        plan = self.plan
        if plan.ask is not None:
            self.prompt = PromptScores.of(out)
        self.seqs = [Seq(self, generator(plan.seed, i)) for i in range(plan.num_samples)]
        self.unfinished = len(self.seqs)
        done = False
        for s in self.seqs:
            done = s.advance(out) or done
        alive = [s for s in self.seqs if not s.out.stop_reason]
        for k, s in enumerate(alive):  # the last one takes the prefilled cache itself, the others forks
            s.cache = cache if k == len(alive) - 1 else cache.fork()
        if not alive:
            cache.release()
        return done

    def release_caches(self) -> None:
        """Give its sequences' KV blocks back."""
        for s in self.seqs:
            if s.cache is not None:
                s.cache.release()
                s.cache = None

    def result(self, dtype: str, stamp: tuple[str, bool], error: LatheError | None = None
               ) -> tuple[Receipt, pb.SampleResult]:
        """Its receipt and answer now (``stamp``: the pool's fingerprint and whether it passed), or ``error``'s."""
        now = time.monotonic()
        started = self.admitted or now
        tokens = len(self.plan.prompt) + sum(len(s.out.tokens) for s in self.seqs) if error is None else 0
        receipt = Receipt(request_id=self.ask.request_id, model_id="", seq_id=self.ask.seq_id, cycle=self.step,
                          tokens=tokens, adapter_step=0, queued_s=started - self.arrived, run_s=now - started,
                          dtype=dtype, op="sample", fingerprint=stamp[0], exact=stamp[1], policy=self.ask.policy)
        if error is not None:
            return receipt, failure(receipt, error)
        return receipt, answer(receipt, self.ask, len(self.plan.prompt), self.prompt, [s.out for s in self.seqs])


@dataclass(slots=True, eq=False)
class Seq:
    request: Request
    gen: torch.Generator
    cache: SeqCache | None = None  # None once finished
    out: Sampled = field(default_factory=Sampled)

    def advance(self, out: ItemOut) -> bool:
        """Draw the next token from its row ``out``; record its logprob; finish it if it stops. True if that
        finished its request (every sample done)."""
        r, seq = self.request, self.out
        token = choose(out.logits, r.plan.rule, self.gen)
        seq.tokens.append(token)
        seq.logprobs.append(float(out.logprobs[token]))
        if r.plan.topk_sample:
            top = torch.topk(out.logprobs, r.plan.topk_sample)
            seq.topk.append((top.indices.tolist(), top.values.tolist()))
        if r.plan.stop.hit(seq.tokens):
            seq.stop_reason = "stop"
        elif len(seq.tokens) >= r.plan.max_tokens:
            seq.stop_reason = "length"
        else:
            return False
        if self.cache is not None:
            self.cache.release()
        self.cache = None
        r.unfinished -= 1
        return r.unfinished == 0
