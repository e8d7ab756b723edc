"""What the registry answers: ``GetInfoResponse``, ``TrainingRun``, ``Checkpoint`` and their list responses with a
``Cursor``, parsed ``tinker://`` paths, and ``GetServerCapabilitiesResponse`` (``SupportedModel``, ``RequestLimits``,
``Exactness``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from lathe.types.config import AdamOptimizerConfig, LoraConfig, OptimizerConfig


@dataclass(slots=True)
class ModelData:
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


@dataclass(slots=True)
class GetInfoResponse:
    """A training client's model: base model, tokenizer, LoRA configuration, context length."""

    model_id: str
    model_data: ModelData
    lora_config: LoraConfig
    max_context_length: int
    optimizer_config: OptimizerConfig = field(default_factory=AdamOptimizerConfig)  # the run's, fixed at creation

    @property
    def model_name(self) -> str | None:
        return self.model_data.model_name

    @property
    def is_lora(self) -> bool:
        return True  # every Lathe model is a LoRA adapter

    @property
    def lora_rank(self) -> int:
        return self.lora_config.rank


CheckpointType = Literal["training", "sampler", "external"]
CHECKPOINT_TYPES: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler",
                                               "external_weights": "external"}
"""A checkpoint's kind (the middle part of its ``tinker://`` path) -> Tinker's ``checkpoint_type``."""


@dataclass(slots=True)
class ParsedCheckpointTinkerPath:
    """``tinker://<training_run_id>/<weights|sampler_weights>/<name>`` taken apart."""

    tinker_path: str
    training_run_id: str
    checkpoint_type: CheckpointType
    checkpoint_id: str  # "<kind>/<name>"

    @classmethod
    def from_tinker_path(cls, tinker_path: str) -> ParsedCheckpointTinkerPath:
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in CHECKPOINT_TYPES \
                or not parts[0] or not parts[2]:
            raise ValueError(f"invalid tinker path {tinker_path!r}; expected "
                             "tinker://<run>/<weights|sampler_weights>/<name>")
        return cls(tinker_path, parts[0], CHECKPOINT_TYPES[parts[1]], f"{parts[1]}/{parts[2]}")


@dataclass(slots=True)
class Checkpoint:
    """A saved artifact. ``time`` and ``size_bytes`` are None where only the path is known (a run's
    ``last_checkpoint``); ``expires_at`` None: never expires."""

    checkpoint_id: str
    checkpoint_type: CheckpointType
    tinker_path: str
    time: datetime | None = None
    size_bytes: int | None = None
    expires_at: datetime | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_tinker_path(cls, tinker_path: str) -> Checkpoint:
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return cls(parsed.checkpoint_id, parsed.checkpoint_type, tinker_path)


@dataclass(slots=True)
class TrainingRun:
    """One model (LoRA adapter) in the gateway's registry; its id is the model id."""

    training_run_id: str
    base_model: str
    lora_config: LoraConfig
    created_at: datetime
    last_request_time: datetime
    user_metadata: dict[str, str] = field(default_factory=dict)
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None

    @property
    def is_lora(self) -> bool:
        return True

    @property
    def lora_rank(self) -> int:
        return self.lora_config.rank


@dataclass(slots=True)
class Cursor:
    offset: int
    limit: int
    total_count: int


@dataclass(slots=True)
class TrainingRunsResponse:
    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass(slots=True)
class CheckpointsListResponse:
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


@dataclass(slots=True)
class Exactness:
    """A model pool's exactness self-check: ``checked`` once the pool loaded the model; ``exact`` when every
    op was batch-invariant there; ``fingerprint`` hashes the bits of a canonical forward."""

    checked: bool = False
    exact: bool = False
    first_failure: str = ""
    fingerprint: str = ""
    detail: str = ""


@dataclass(slots=True)
class SupportedModel:
    """A served base model. ``logprobs_exact``: its trainer and sampler pools are both checked and exact,
    with equal fingerprints, so sampled logprobs equal the trainer's bit for bit."""

    model_name: str
    max_context_length: int
    trainer_exactness: Exactness = field(default_factory=Exactness)
    sampler_exactness: Exactness = field(default_factory=Exactness)
    logprobs_exact: bool = False


@dataclass(slots=True)
class RequestLimits:
    """What one request may ask for; the server refuses larger ones (``InvalidArgument``) before any work."""

    max_message_bytes: int
    max_samples: int
    max_topk_prompt_logprobs: int
    max_stop_sequences: int
    max_stop_chars: int
    max_tensor_elements: int
    max_sample_tokens: int = 0  # num_samples x (prompt + max_tokens) of one sample; 0: the server did not say


@dataclass(slots=True)
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]
    limits: RequestLimits | None = None  # None: the server did not say
