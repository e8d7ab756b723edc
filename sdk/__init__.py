"""Lathe: self-hosted multi-tenant LoRA fine-tuning with the Tinker API.

This package is the client SDK. Code written for the official ``tinker`` SDK needs only its import changed::

    import lathe as tinker

    with tinker.ServiceClient(base_url="127.0.0.1:8500", api_key="tml-...") as sc:
        tc = sc.create_lora_training_client("lathe/tiny-llama", rank=8)
        datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                             loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(tinker.AdamParams(learning_rate=1e-4))
        print(fb.result().metrics["loss:sum"], opt.result().receipt)

Rooms: ``types`` (the values, as Tinker names them), ``wire`` / ``info_wire`` (types <-> ``lathe.v1`` messages),
``futures`` (connection, retries, ``APIFuture``), ``connect`` (where the gateway is), ``service_client`` /
``training_client`` / ``sampling_client`` / ``rest_client`` (the clients), ``tokenizer`` (a base model's
tokenizer, found locally), ``errors`` (one error model for client and server). The SDK talks gRPC to the gateway
(``lathe.v1.Gateway``) and never imports torch at module level. The server side lives in ``lathe.gateway``,
``lathe.trainer``, ``lathe.sampler`` and ``lathe.checkpoints``.
"""

from lathe import types
from lathe.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LatheError,
    NotFound,
    PermissionDenied,
    RequestTooLarge,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from lathe.futures import APIFuture, RetryPolicy
from lathe.rest_client import RestClient
from lathe.sampling_client import SamplingClient
from lathe.service_client import ServiceClient
from lathe.training_client import TrainingClient
from lathe.types import (
    AdamOptimizerConfig,
    AdamParams,
    Checkpoint,
    CheckpointsListResponse,
    CreateModelResponse,
    Cursor,
    Datum,
    DimuonOptimizerConfig,
    DimuonParams,
    EncodedTextChunk,
    Exactness,
    ForwardBackwardOutput,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LoadWeightsResponse,
    LoraConfig,
    LossFnOutput,
    ModelData,
    ModelInput,
    OptimStepResponse,
    ParsedCheckpointTinkerPath,
    QueueState,
    Receipt,
    RequestLimits,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
    TensorData,
    TensorDtype,
    TrainingRun,
    TrainingRunsResponse,
)

__all__ = [
    "APIFuture",
    "AdamOptimizerConfig",
    "AdamParams",
    "AlreadyExists",
    "Checkpoint",
    "CheckpointsListResponse",
    "CreateModelResponse",
    "Cursor",
    "Datum",
    "DimuonOptimizerConfig",
    "DimuonParams",
    "EncodedTextChunk",
    "FailedPrecondition",
    "Exactness",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetServerCapabilitiesResponse",
    "Internal",
    "InvalidArgument",
    "LatheError",
    "LoadWeightsResponse",
    "LoraConfig",
    "LossFnOutput",
    "ModelData",
    "ModelInput",
    "NotFound",
    "OptimStepResponse",
    "ParsedCheckpointTinkerPath",
    "PermissionDenied",
    "QueueState",
    "Receipt",
    "RequestLimits",
    "RequestTooLarge",
    "ResourceExhausted",
    "RestClient",
    "RetryPolicy",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServiceClient",
    "SupportedModel",
    "TensorData",
    "TensorDtype",
    "TrainingClient",
    "TrainingRun",
    "TrainingRunsResponse",
    "Unauthenticated",
    "Unavailable",
    "types",
]
