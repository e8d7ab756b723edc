"""Choosing the next token from one row of logits.

The logprob reported for the chosen token is not affected by any of this: it is
``log_softmax(logits)[token]`` at temperature 1 (``step.run_step``), the policy's own logprob and the
number the trainer computes for the same token.

    choose(logits [V] fp32, rule, gen) -> token id:
      temperature == 0      argmax(logits)                                  (greedy; first on ties)
      otherwise             x = (logits - max(logits)) / temperature
                            top_k > 0:  x[x < k-th largest x] = -inf
                            top_p < 1:  keep the most likely tokens whose probability mass, summed in
                                        descending order, first reaches top_p (at least one token)
                            token ~ softmax(x), drawn with ``gen``

    draw(logits [R, V] fp32, temperature, k, gen) -> tokens [R, k]   (``prompt_alt_tokens_k``)
      temperature == 0      argmax(logits[r]) k times per row
      otherwise             tokens[r] ~ softmax((logits[r] - max(logits[r])) / temperature), k draws with
                            replacement, rows in order, drawn with ``gen`` (no top-k / top-p: the request's
                            temperature alone, as Tinker defines the option)

Each sequence owns a ``torch.Generator`` seeded from (request seed, sample index), so a seeded request
draws the same tokens whatever else shares its batch (its logits row has the same bits too); a request's
prompt draws have a generator of their own (``stream="prompt-alt"``).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Rule:
    """The selection half of Tinker's SamplingParams (already validated)."""

    temperature: float = 1.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # 1.0: off


def random_seed() -> int:
    """A fresh 63-bit seed for a request that did not ask for one."""
    return secrets.randbits(63)


def _derived(seed: int, index: int, stream: str, nbytes: int) -> int:
    """A non-negative ``8 * nbytes - 1``-bit integer derived from (``seed``, ``index``, ``stream``)."""
    digest = hashlib.sha256(f"lathe-{stream}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:nbytes], "little") >> 1


def generator(seed: int, index: int, stream: str = "sample") -> torch.Generator:
    """The generator of sample ``index`` of a request seeded with ``seed`` (independent per index and stream)."""
    return torch.Generator().manual_seed(_derived(seed, index, stream, 8))


def sample_seed(seed: int, index: int) -> int:
    """The 31-bit seed an external engine (sglang: ``sampling_seed``) draws sample ``index`` of a request seeded with
    ``seed`` with: independent per index, the same for the same request."""
    return _derived(seed, index, "engine-sample", 4)


def choose(logits: torch.Tensor, rule: Rule, gen: torch.Generator) -> int:
    """The next token for one sequence from its logits row ``[V]`` (fp32, on the CPU).

    Raises ``ValueError`` when the row holds NaN or inf (a broken adapter), instead of drawing junk.
    """
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the model produced non-finite logits (NaN or inf); the adapter weights may be broken")
    if rule.temperature == 0.0:
        return int(torch.argmax(logits))
    x = (logits - logits.max()) / rule.temperature  # <= 0 everywhere: no overflow at tiny temperatures
    vocab = x.shape[0]
    if 0 < rule.top_k < vocab:
        kth = torch.topk(x, rule.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if rule.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=0) - sorted_p
        drop = mass_before >= rule.top_p
        drop[0] = False
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))


def draw(logits: torch.Tensor, temperature: float, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` independent draws per row of ``logits [R, V]`` (fp32, on the CPU) at ``temperature`` -> ``[R, k]``."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the model produced non-finite logits (NaN or inf); the adapter weights may be broken")
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1, keepdim=True).expand(-1, k).contiguous()
    probs = torch.softmax((logits - logits.max(dim=-1, keepdim=True).values) / temperature, dim=-1)
    return torch.multinomial(probs, k, replacement=True, generator=gen)
