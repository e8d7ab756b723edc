"""Sampling's values (``SamplingParams``, ``SampledSequence``, ``SampleResponse``), the queue states a pending future
reports, and the checkpoint lifetimes and paths the client and the services agree on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from lathe.types.results import Receipt
from lathe.types.tensors import TensorData

EPHEMERAL_TTL_S = 24 * 3600
"""Unnamed sampler snapshots (``save_weights_and_get_sampling_client()``, one per RL step) expire after a day."""
MAX_TTL_S = 10 * 365 * 24 * 3600
"""The longest ``ttl_seconds`` a checkpoint may ask for (ten years; 0 keeps it forever)."""
CLIENT_STRIDE = 1_000_000_000
"""Client ``n`` of a sampling session (its creator is 0, each joiner the next number) sends ``seq_id``s from
``n * CLIENT_STRIDE + 1``, as Tinker's SDK numbers its clones; the gateway reads the client back from them."""


class QueueState(Enum):
    """Why a tenant's work waits, as a pending future's poll reports it (``SamplingClient.on_queue_state_change``):
    a full trainer queue (``PAUSED_CAPACITY``), one of the tenant's quotas (``PAUSED_RATE_LIMIT``), or nothing."""

    ACTIVE = "active"
    PAUSED_RATE_LIMIT = "paused_rate_limit"
    PAUSED_CAPACITY = "paused_capacity"
    UNKNOWN = "unknown"

    @classmethod
    def _missing_(cls, value: object) -> QueueState:
        return cls.UNKNOWN  # a state a newer gateway names
RECOVERY_KIND, RECOVERY_NAME = "recovery", "latest"
"""A trainer's own recovery snapshot of a run (``lathe.trainer.recovery``): one per run, overwritten in place,
never listed among the run's checkpoints; the gateway rebuilds a run from it after a trainer restart."""


def recovery_path(model_id: str) -> str:
    """``tinker://<model_id>/recovery/latest``: where the trainer keeps the run's recovery snapshot."""
    return f"tinker://{model_id}/{RECOVERY_KIND}/{RECOVERY_NAME}"


StopReason = Literal["stop", "length"]


@dataclass(slots=True)
class SamplingParams:
    """Tinker's sampling parameters. ``stop``: None = stop at EOS; ``[]`` = never stop early (not even at
    EOS); a string or list of strings; or a list of token ids. ``max_tokens`` None = up to the context."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


@dataclass(slots=True)
class SampledSequence:
    """One completion: its tokens, the policy's logprob of each (temperature 1), why it ended, and which
    policy version (sampler weights path or base model) produced it."""

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    policy_version: str = ""
    topk_logprobs: list[list[tuple[int, float]] | None] | None = None  # topk_sample_logprobs: per token, best first


@dataclass(slots=True)
class PromptAltTokens:
    """``prompt_alt_tokens_k`` draws: row ``i`` holds ``k`` alternatives to prompt token ``i + 1``, drawn with
    replacement at the request's temperature, and the policy's logprob of each."""

    tokens: TensorData  # int64 [len(prompt) - 1, k]
    logprobs: TensorData  # float32 [len(prompt) - 1, k]


@dataclass(slots=True)
class SampleResponse:
    """``prompt_logprobs[0]`` is None (nothing predicts the first token), and so is every position before
    the last ``prompt_logprobs_last_n``; ``topk_prompt_logprobs[i]`` is a list of (token id, logprob), best
    first (None where not scored). ``target_prompt_logprobs``: float32, shaped like the request's ids, 0.0
    where the request had -1."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    receipt: Receipt | None = None
