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

One module per kind: ``tensors`` (model input, tensors, datums), ``config`` (optimizers, LoRA), ``results`` (what
training futures resolve to), ``sampling`` (sampling values, queue states, checkpoint lifetimes), ``registry`` (the
registry's answers); every name is importable from here.
"""

from __future__ import annotations

from lathe.types.config import (
    OPTIMIZERS,
    AdamOptimizerConfig,
    AdamParams,
    DimuonOptimizerConfig,
    DimuonParams,
    LoraConfig,
    OptimizerConfig,
    OptimParams,
    check_no_project,
    check_weights_access_token,
    optim_params_of,
    optimizer_family,
)
from lathe.types.registry import (
    CHECKPOINT_TYPES,
    Checkpoint,
    CheckpointsListResponse,
    CheckpointType,
    Cursor,
    Exactness,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    ModelData,
    ParsedCheckpointTinkerPath,
    RequestLimits,
    SupportedModel,
    TrainingRun,
    TrainingRunsResponse,
)
from lathe.types.results import (
    CreateModelResponse,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LossFnOutput,
    OptimStepResponse,
    Receipt,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    console_page,
)
from lathe.types.sampling import (
    CLIENT_STRIDE,
    EPHEMERAL_TTL_S,
    MAX_TTL_S,
    RECOVERY_KIND,
    RECOVERY_NAME,
    PromptAltTokens,
    QueueState,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    recovery_path,
)
from lathe.types.tensors import (
    LOSS_INPUT_DTYPES,
    NUMPY_DTYPES,
    Datum,
    EncodedTextChunk,
    ModelInput,
    TensorData,
    TensorDtype,
    as_tensor_data,
)

__all__ = [
    "TensorDtype",
    "NUMPY_DTYPES",
    "LOSS_INPUT_DTYPES",
    "EncodedTextChunk",
    "ModelInput",
    "TensorData",
    "as_tensor_data",
    "Datum",
    "AdamParams",
    "DimuonParams",
    "OptimParams",
    "AdamOptimizerConfig",
    "DimuonOptimizerConfig",
    "OptimizerConfig",
    "OPTIMIZERS",
    "optimizer_family",
    "optim_params_of",
    "check_no_project",
    "check_weights_access_token",
    "LoraConfig",
    "Receipt",
    "LossFnOutput",
    "ForwardBackwardOutput",
    "OptimStepResponse",
    "console_page",
    "SaveWeightsResponse",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsExternalResponse",
    "LoadWeightsResponse",
    "CreateModelResponse",
    "EPHEMERAL_TTL_S",
    "MAX_TTL_S",
    "CLIENT_STRIDE",
    "QueueState",
    "RECOVERY_KIND",
    "RECOVERY_NAME",
    "recovery_path",
    "StopReason",
    "SamplingParams",
    "SampledSequence",
    "PromptAltTokens",
    "SampleResponse",
    "ModelData",
    "GetInfoResponse",
    "CheckpointType",
    "CHECKPOINT_TYPES",
    "ParsedCheckpointTinkerPath",
    "Checkpoint",
    "TrainingRun",
    "Cursor",
    "TrainingRunsResponse",
    "CheckpointsListResponse",
    "Exactness",
    "SupportedModel",
    "RequestLimits",
    "GetServerCapabilitiesResponse",
]
