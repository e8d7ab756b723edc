"""What a training future resolves to (``ForwardBackwardOutput``, ``OptimStepResponse``, the save and load responses,
``CreateModelResponse``), each with the ``Receipt`` of the operation that produced it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lathe.errors import FailedPrecondition
from lathe.types.tensors import TensorData


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
