"""The values a Lathe user builds and gets back, named and shaped like the official ``tinker`` SDK's types.

Plain dataclasses, owned by the user's process; ``lathe.wire`` turns them into ``lathe.v1`` messages and
back, and nothing here knows about gRPC. Code written against ``tinker.types`` keeps working with
``from lathe import types``.

- Inputs: ``ModelInput`` (a list of ``EncodedTextChunk``), ``TensorData`` (a flat array + dtype + shape),
  ``Datum`` (model input + ``loss_fn_inputs``), ``AdamParams``, ``LoraConfig``.
- Results of training futures: ``ForwardBackwardOutput``, ``OptimStepResponse``, ``SaveWeightsResponse``,
  ``SaveWeightsForSamplerResponse``, ``SaveWeightsExternalResponse``, ``LoadWeightsResponse``,
  ``CreateModelResponse``; each carries the
  ``Receipt`` of the operation that produced it (None when the server sent none).
- Registry views: ``GetInfoResponse`` (+ ``ModelData``), ``TrainingRun``, ``Checkpoint``, the list responses
  with their ``Cursor``, and ``GetServerCapabilitiesResponse`` (+ ``SupportedModel``, ``RequestLimits``);
  sessions, storage usage, weights info and the like are ``lathe.registry_types``.

torch is never imported here at module level: only ``TensorData.from_torch`` / ``to_torch`` import it, and
a ``Datum`` recognises a torch tensor only when the caller has already imported torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from lathe.errors import FailedPrecondition, InvalidArgument, PermissionDenied

if TYPE_CHECKING:
    import torch

TensorDtype = Literal["int64", "float32", "int32"]
NUMPY_DTYPES: dict[str, type[np.generic]] = {"int64": np.int64, "float32": np.float32, "int32": np.int32}

# The dtype Tinker gives a plain-list loss input of each known key (other keys: by the values' kind).
LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
}


# ---------- model input ----------


@dataclass(slots=True)
class EncodedTextChunk:
    """A run of token ids."""

    tokens: Sequence[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ModelInput:
    """The tokens a model reads, as chunks (only encoded text for now)."""

    chunks: list[EncodedTextChunk]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [int(t) for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        """The number of context positions this input takes."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        """A new ModelInput with ``chunk`` added at the end."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        """A new ModelInput with one more token."""
        return self.append(EncodedTextChunk(tokens=[token]))


# ---------- tensors and data ----------


def _dtype_of_kind(kind: str, what: str) -> TensorDtype:
    """Tinker's rule: floating point -> float32, integers and booleans -> int64."""
    if kind == "f":
        return "float32"
    if kind in "iub":
        return "int64"
    raise ValueError(f"{what} has element kind {kind!r}; expected numbers")


@dataclass(slots=True, eq=False)
class TensorData:
    """A dense tensor: flat ``data`` (list or numpy array), ``dtype`` and ``shape`` (None: 1-D).

    Equality compares dtype, shape and values.
    """

    data: list[int] | list[float] | np.ndarray
    dtype: TensorDtype
    shape: list[int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"TensorData.dtype = {self.dtype!r}; expected one of {sorted(NUMPY_DTYPES)}")
        if isinstance(self.data, np.ndarray) and self.data.ndim != 1:
            if self.shape is None:
                self.shape = list(self.data.shape)
            self.data = self.data.reshape(-1)
        if self.shape is not None:
            self.shape = [int(d) for d in self.shape]
            if any(d < 0 for d in self.shape):
                raise ValueError(f"TensorData.shape = {self.shape} has a negative dimension")
            if math.prod(self.shape) != len(self.data):
                raise ValueError(f"TensorData.shape = {self.shape} holds {math.prod(self.shape)} values, "
                                 f"but data has {len(self.data)}")

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = _dtype_of_kind(array.dtype.kind, f"numpy array of dtype {array.dtype}")
        return cls(data=array.astype(NUMPY_DTYPES[dtype]).reshape(-1), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        import torch

        dtype: TensorDtype = "float32" if tensor.dtype.is_floating_point else "int64"
        flat = tensor.detach().to("cpu", getattr(torch, dtype)).reshape(-1).numpy()
        return cls(data=flat, dtype=dtype, shape=list(tensor.shape))

    def to_numpy(self) -> np.ndarray:
        arr = np.asarray(self.data, dtype=NUMPY_DTYPES[self.dtype])
        return arr.reshape(self.shape) if self.shape is not None else arr

    def to_torch(self) -> torch.Tensor:
        import torch

        return torch.tensor(self.to_numpy())

    def tolist(self) -> list[Any]:
        return self.to_numpy().tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorData):
            return NotImplemented
        a, b = self.to_numpy(), other.to_numpy()
        return self.dtype == other.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if its creator imported torch
    return torch is not None and isinstance(value, torch.Tensor)


def as_tensor_data(key: str, value: object) -> TensorData:
    """One ``loss_fn_inputs`` value as TensorData, converted the way Tinker's ``Datum`` does.

    numpy arrays and torch tensors keep their kind (floating -> float32, integer -> int64); plain lists take
    the dtype of their key (``target_tokens`` int64; ``weights``, ``advantages``, ``logprobs`` float32) or,
    for other keys, of their values.
    """
    if isinstance(value, TensorData):
        return value
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if _is_torch_tensor(value):
        return TensorData.from_torch(value)
    if isinstance(value, list | tuple):
        what = f"loss_fn_inputs[{key!r}]"
        try:
            array = np.asarray(value)
        except ValueError:  # ragged nesting
            array = np.asarray(None)
        if array.dtype == object:
            raise ValueError(f"{what} must be a rectangular array of numbers")
        dtype = LOSS_INPUT_DTYPES.get(key) or _dtype_of_kind(array.dtype.kind, what)
        return TensorData.from_numpy(array.astype(NUMPY_DTYPES[dtype]))
    raise TypeError(f"loss_fn_inputs[{key!r}] is a {type(value).__name__}; expected TensorData, "
                    "a numpy array, a torch tensor or a list of numbers")


@dataclass(slots=True)
class Datum:
    """One training example: the model input and the loss function's per-token inputs.

    ``loss_fn_inputs`` values may be TensorData, numpy arrays, torch tensors or lists; the constructor
    converts them (see ``as_tensor_data``).
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    def __post_init__(self) -> None:
        self.loss_fn_inputs = {k: as_tensor_data(k, v) for k, v in self.loss_fn_inputs.items()}


# ---------- configuration ----------


@dataclass(slots=True)
class AdamParams:
    """One AdamW step's hyperparameters (decoupled weight decay; grad_clip_norm 0 = no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> AdamParams:
        """Refuse what AdamW cannot use (``InvalidArgument`` naming the field and value); returns ``self``.

        Every value finite; learning_rate, weight_decay, grad_clip_norm >= 0; betas in [0, 1); eps > 0 (eps 0
        divides zero by zero on a parameter that has no gradient yet)."""
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                raise InvalidArgument(f"adam_params.{name} = {value!r} must be a finite number >= 0")
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise InvalidArgument(f"adam_params.{name} = {getattr(self, name)} must be < 1")
        if self.eps <= 0:
            raise InvalidArgument(f"adam_params.eps = {self.eps} must be > 0")
        return self


@dataclass(frozen=True, slots=True)
class DimuonParams:
    """One Dimuon step's hyperparameters (a run created with ``DimuonOptimizerConfig``; grad_clip_norm <= 0 =
    no clipping). The update itself is ``lathe.trainer.dimuon``'s."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    type: Literal["dimuon"] = "dimuon"

    def check(self) -> DimuonParams:
        """Refuse what Dimuon cannot use (``InvalidArgument`` naming the field and value); returns ``self``:
        every value finite, learning_rate >= 0, beta1 in [0, 1)."""
        for name in ("learning_rate", "grad_clip_norm", "beta1"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidArgument(f"dimuon_params.{name} = {value!r} must be a finite number")
        if self.learning_rate < 0:
            raise InvalidArgument(f"dimuon_params.learning_rate = {self.learning_rate} must be >= 0")
        if not 0 <= self.beta1 < 1:
            raise InvalidArgument(f"dimuon_params.beta1 = {self.beta1} must be in [0, 1)")
        return self


OptimParams = AdamParams | DimuonParams


@dataclass(frozen=True, slots=True)
class AdamOptimizerConfig:
    """The optimizer family of a training run, chosen at creation (Tinker's ``optimizer=``): AdamW, whose
    per-step hyperparameters are ``AdamParams``."""

    type: Literal["adamw"] = "adamw"


@dataclass(frozen=True, slots=True)
class DimuonOptimizerConfig:
    """Dimuon as a training run's optimizer family; its per-step hyperparameters are ``DimuonParams``."""

    type: Literal["dimuon"] = "dimuon"
    version: Literal[1] = 1


OptimizerConfig = AdamOptimizerConfig | DimuonOptimizerConfig
OPTIMIZERS = ("adamw", "dimuon")


def optimizer_family(optimizer: object | None) -> str:
    """The family a creation's ``optimizer=`` names: None is AdamW; a config (Lathe's or tinker's) by its
    ``type``; anything else is refused."""
    kind = "adamw" if optimizer is None else getattr(optimizer, "type", None)
    if kind not in OPTIMIZERS:
        raise InvalidArgument(f"optimizer = {optimizer!r}: Lathe trains with {' or '.join(OPTIMIZERS)} "
                              "(AdamOptimizerConfig, DimuonOptimizerConfig, or None for AdamW)")
    return str(kind)


def optim_params_of(optim_params: object | None, adam_params: AdamParams | None) -> OptimParams:
    """The checked params of an ``optim_step(optim_params, *, adam_params)`` call (Tinker's two spellings)."""
    if optim_params is not None and adam_params is not None:
        raise InvalidArgument("optim_step takes optim_params or the legacy adam_params, not both")
    params = optim_params if optim_params is not None else adam_params
    if not isinstance(params, AdamParams | DimuonParams):
        raise InvalidArgument(f"optim_params = {params!r}: pass AdamParams or DimuonParams")
    return params.check()


def check_no_project(name: str, project: object | None) -> None:
    """Tinker's projects: Lathe has tenants (API keys), not projects, so a project given is refused rather than
    ignored (None, "" and [] name none). The one wording of that refusal, for the SDK and both doors."""
    if project:
        raise InvalidArgument(f"{name} = {project!r}: Lathe has tenants (API keys), not projects; leave {name} "
                              "out to use your own")


def check_weights_access_token(weights_access_token: str | None) -> None:
    """Tinker's token for another account's weights: Lathe's checkpoints stay with their tenant, so none is
    honoured and a given one is refused rather than ignored."""
    if weights_access_token is not None:
        raise PermissionDenied("weights_access_token: Lathe shares no weights across accounts; load your own "
                               "checkpoints without a token")


@dataclass(slots=True)
class LoraConfig:
    """Which modules get LoRA adapters and how they start. ``alpha`` None: the server's default (32)."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float | None = None


# ---------- results of futures ----------


@dataclass(slots=True)
class Receipt:
    """What ran, where, on which adapter version, and how long it waited and ran."""

    request_id: str
    model_id: str
    seq_id: int
    cycle: int
    tokens: int
    adapter_step: int  # optimizer steps applied to the adapter before this operation
    queued_s: float
    run_s: float
    dtype: str
    op: str
    fingerprint: str = ""  # exactness fingerprint of the pool that computed it (lathe.models.exactness)
    exact: bool = False  # that pool passed its exactness self-check
    policy: str = ""  # a sample's: the sampler checkpoint (or base model) every token of it ran on


LossFnOutput = dict[str, TensorData]


@dataclass(slots=True)
class ForwardBackwardOutput:
    """Per-datum outputs (e.g. ``logprobs``) and metrics keyed ``name:reduction`` (always ``loss:sum``)."""

    loss_fn_output_type: str
    loss_fn_outputs: list[LossFnOutput]
    metrics: dict[str, float] = field(default_factory=dict)
    receipt: Receipt | None = None


@dataclass(slots=True)
class OptimStepResponse:
    metrics: dict[str, float] | None = None
    receipt: Receipt | None = None


def console_page(root: str, page: str) -> str:
    """``page`` of the gateway's web console at ``root`` ("": the gateway serves none)."""
    if not root:
        raise FailedPrecondition("this gateway serves no web console (it runs without its HTTP door)")
    return f"{root}/{page}"


class _ConsoleLink:
    """A save's page in the gateway's web console (``console_url``; "" when the gateway serves no HTTP door)."""

    __slots__ = ()
    console_url: str

    def get_console_url(self) -> str:
        return console_page(self.console_url, "").removesuffix("/")


@dataclass(slots=True)
class SaveWeightsResponse(_ConsoleLink):
    """``path``: ``tinker://<run>/weights/<name>``, a training state (adapter + optimizer)."""

    path: str
    receipt: Receipt | None = None
    console_url: str = ""


@dataclass(slots=True)
class SaveWeightsForSamplerResponse(_ConsoleLink):
    """``path``: ``tinker://<run>/sampler_weights/<name>``, a PEFT-style adapter for sampling."""

    path: str
    receipt: Receipt | None = None
    console_url: str = ""


@dataclass(slots=True)
class SaveWeightsExternalResponse:
    """``path``: ``tinker://<run>/external_weights/<name>``, PEFT files to download (``RestClient.
    get_external_weights_urls``), age-encrypted when recipients were named."""

    path: str
    receipt: Receipt | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


@dataclass(slots=True)
class LoadWeightsResponse:
    path: str | None = None
    model_id: str | None = None
    receipt: Receipt | None = None


@dataclass(slots=True)
class CreateModelResponse:
    model_id: str


# ---------- sampling ----------

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


# ---------- registry views ----------


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
