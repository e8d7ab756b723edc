"""``TrainingClient``: one LoRA adapter (a training run) on the gateway, driven like Tinker's.

Owns the client side of per-model ordering: a ``seq_id`` counter starting at 1, reserved under a lock in
the order the user calls the methods, and a chain of turns so that each operation is *submitted* only after
the one before it (the gateway additionally runs them strictly in ``seq_id`` order). A submit that fails with
UNAVAILABLE is retried with the same ``seq_id``. A submit that fails for good leaves a gap the server would
wait on forever, so it poisons the client: every later operation fails with ``FailedPrecondition`` (as in
Tinker), and a new client must be created (e.g. from the last saved state).

Every operation returns an ``APIFuture`` at once; the ``*_async`` variants are coroutines that return the
same future. The model math, the adapter and its optimizer state live on the server, never here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import numbers
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import numpy as np
from google.protobuf.message import Message

from lathe import wire
from lathe.errors import FailedPrecondition, InvalidArgument, LatheError
from lathe.futures import APIFuture, Connection, RetryPolicy, server_future
from lathe.loss_trace import LossHandle
from lathe.registry_types import SamplingClientKind
from lathe.sampling_client import SamplingClient
from lathe.tokenizer import load_tokenizer
from lathe.types import (
    EPHEMERAL_TTL_S,
    MAX_TTL_S,
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimParams,
    OptimStepResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    check_weights_access_token,
    console_page,
    optim_params_of,
)
from lathe.v1 import lathe_pb2 as pb

R = TypeVar("R")


def _loss_fn_config(config: Mapping[str, float] | None) -> dict[str, float]:
    out = {}
    for key, value in (config or {}).items():
        if not isinstance(value, numbers.Real):
            raise ValueError(f"loss_fn_config[{key!r}] = {value!r}; Lathe's loss configs take numbers only")
        out[key] = float(value)
    return out


CustomLossFn = Callable[[Sequence[Datum], list[Any]], tuple[Any, dict[str, float]]]
"""``(data, logprobs: list[torch.Tensor]) -> (loss: scalar torch.Tensor, metrics)``."""


def _ce_datum(d: Datum, weights: np.ndarray | None) -> Datum:
    """``d`` as a cross_entropy datum with the given weights (zeros: a forward that trains nothing)."""
    if "target_tokens" not in d.loss_fn_inputs:
        raise ValueError("forward_backward_custom needs loss_fn_inputs['target_tokens'] in every datum")
    targets = d.loss_fn_inputs["target_tokens"]
    w = weights if weights is not None else np.zeros(len(targets.tolist()), dtype=np.float32)
    return Datum(model_input=d.model_input,
                 loss_fn_inputs={"target_tokens": targets, "weights": TensorData.from_numpy(w.astype(np.float32))})


def _custom_loss_weights(data: Sequence[Datum], out: ForwardBackwardOutput, loss_fn: CustomLossFn
                         ) -> tuple[list[np.ndarray], float, dict[str, float]]:
    import torch  # only here: the SDK does not need torch otherwise

    logprobs = [torch.tensor(o["logprobs"].to_numpy(), dtype=torch.float32, requires_grad=True)
                for o in out.loss_fn_outputs]
    loss, metrics = loss_fn(data, logprobs)
    loss.backward()
    weights = [(-lp.grad if lp.grad is not None else torch.zeros_like(lp)).numpy() for lp in logprobs]
    return weights, float(loss.detach()), dict(metrics)


def _check_kind(kind: str) -> None:
    if kind not in ("snapshot", "inflight"):
        raise InvalidArgument(f"kind = {kind!r}: a sampling client is 'snapshot' (pinned to the weights saved now) or "
                              "'inflight' (following this run's later inflight saves)")


def _sampler_name(name: str | None) -> tuple[str, int | None]:
    """(name, ttl): an unnamed sampler snapshot gets a fresh name and expires after a day."""
    return (name, None) if name else (f"ephemeral-{uuid.uuid4().hex[:12]}", EPHEMERAL_TTL_S)


class TrainingClient:
    """Created by ``ServiceClient.create_lora_training_client`` / ``create_training_client_from_state*``."""

    def __init__(self, conn: Connection, info: GetInfoResponse,
                 sampling_client: Callable[..., Awaitable[SamplingClient]], console: str = "") -> None:
        """``console``: the root of the gateway's web console ("": it serves none)."""
        self.model_id = info.model_id
        self._console = console
        self._conn = conn
        self._sampling_client = sampling_client
        self._info = info
        self._lock = threading.Lock()
        self._next_seq = 1
        self._last_turn: cf.Future[None] = cf.Future()
        self._last_turn.set_result(None)
        self._failed: tuple[int, LatheError] | None = None  # (seq_id, error) of the first failed submit

    def __repr__(self) -> str:
        return f"<TrainingClient {self.model_id} on {self._info.model_name}>"

    def get_console_url(self) -> str:
        """This run's page in the gateway's web console: its curves and checkpoints."""
        return console_page(self._console, f"training_runs/{quote(self.model_id, safe='')}")

    # ---- ordered submission ----

    def _submit(self, rpc: str, request: Message | Callable[[], Awaitable[Message]], kind: type[R]) -> APIFuture[R]:
        """Reserve the next seq_id for ``request`` and submit it after every earlier one.

        ``request`` may be a coroutine function that builds the message once the turn has come (what
        ``forward_backward_custom`` needs: its backward depends on its forward's result).
        """
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            prev, mine = self._last_turn, cf.Future()
            self._last_turn = mine
        return server_future(self._conn, self._in_turn(seq, prev, mine, rpc, request),
                             functools.partial(wire.result_from_proto, kind=kind))

    async def _in_turn(self, seq: int, prev: cf.Future[None], mine: cf.Future[None], rpc: str,
                       request: Message | Callable[[], Awaitable[Message]]) -> str:
        try:
            await asyncio.wrap_future(prev)
            if self._failed is not None:
                first, err = self._failed
                raise FailedPrecondition(
                    f"{self.model_id}: seq_id {seq} was not submitted because seq_id {first} failed to submit "
                    f"({type(err).__name__}: {err.message}); create a new training client")
            try:
                if not isinstance(request, Message):
                    request = await request()
                request.seq_id = seq
                return (await self._conn.call(rpc, request)).request_id
            except LatheError as e:
                self._failed = (seq, e)
                raise
        finally:
            mine.set_result(None)

    # ---- operations ----

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """The loss and per-datum outputs (e.g. ``logprobs``) without gradients."""
        return self._forward_backward(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradients of ``loss_fn`` (a sum over tokens) into the adapter."""
        return self._forward_backward(data, loss_fn, loss_fn_config, forward_only=False)

    def _forward_backward(self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None,
                          *, forward_only: bool) -> APIFuture[ForwardBackwardOutput]:
        if not data:
            raise ValueError("no data given: pass at least one Datum")
        request = pb.ForwardBackwardRequest(model_id=self.model_id, data=[wire.datum_to_proto(d) for d in data],
                                            loss_fn=loss_fn, loss_fn_config=_loss_fn_config(loss_fn_config),
                                            forward_only=forward_only)
        return self._submit("ForwardBackward", request, ForwardBackwardOutput)

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: CustomLossFn | LossHandle, *,
                                loss_type_input: Literal["logprobs"] | None = None
                                ) -> APIFuture[ForwardBackwardOutput]:
        """Tinker's custom loss.

        A ``LossHandle`` (``ServiceClient.create_custom_loss``) runs on the server: one forward_backward with
        ``loss_fn="custom"`` carrying the traced graph. A callable runs here, with no user code on the server
        (1.5x the FLOPs of a plain step): a forward returns each datum's target logprobs;
        ``loss_fn(data, logprobs) -> (loss, metrics)`` runs in torch; then a ``cross_entropy`` forward_backward
        with ``weights = -dloss/dlogprobs`` puts exactly that gradient into the adapter. Datums need
        ``target_tokens``; other inputs are the loss's. ``loss_type_input``: what ``loss_fn`` reads,
        ``"logprobs"`` (the default and only kind, as in Tinker).
        """
        if loss_type_input not in (None, "logprobs"):
            raise InvalidArgument(f"loss_type_input = {loss_type_input!r}; custom losses read 'logprobs'")
        if isinstance(loss_fn, LossHandle):
            if not data:
                raise ValueError("no data given: pass at least one Datum")
            return self._submit("ForwardBackward", pb.ForwardBackwardRequest(
                model_id=self.model_id, data=[wire.datum_to_proto(d) for d in data], loss_fn="custom",
                custom_loss=loss_fn.to_proto()), ForwardBackwardOutput)
        forward = self.forward([_ce_datum(d, None) for d in data], "cross_entropy")
        custom: dict[str, Any] = {}

        async def backward_request() -> pb.ForwardBackwardRequest:
            out = await forward
            weights, custom["loss"], custom["metrics"] = _custom_loss_weights(data, out, loss_fn)
            custom["out"] = out
            return pb.ForwardBackwardRequest(
                model_id=self.model_id, loss_fn="cross_entropy",
                data=[wire.datum_to_proto(_ce_datum(d, w)) for d, w in zip(data, weights, strict=True)])

        backward = self._submit("ForwardBackward", backward_request, ForwardBackwardOutput)

        async def combine() -> ForwardBackwardOutput:
            res = await backward
            out = custom["out"]
            return ForwardBackwardOutput(out.loss_fn_output_type, out.loss_fn_outputs,
                                         {**custom["metrics"], "loss:sum": custom["loss"]}, res.receipt)

        return APIFuture(self._conn.spawn(combine()))

    async def forward_backward_custom_async(self, data: Sequence[Datum], loss_fn: CustomLossFn | LossHandle, *,
                                            loss_type_input: Literal["logprobs"] | None = None
                                            ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    def optim_step(self, optim_params: OptimParams | None = None, *, adam_params: AdamParams | None = None
                   ) -> APIFuture[OptimStepResponse]:
        """One update of the adapter with the gradients accumulated since the last step.

        ``optim_params`` (or Tinker's legacy keyword ``adam_params``) is an ``AdamParams`` or a ``DimuonParams``,
        matching the optimizer the run was created with (the server refuses the other). Raises
        ``InvalidArgument`` at once for anything else and for hyperparameters the optimizer cannot use."""
        request = wire.optim_step_to_proto(self.model_id, optim_params_of(optim_params, adam_params))
        return self._submit("OptimStep", request, OptimStepResponse)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[SaveWeightsResponse]:
        """Save the training state (adapter + optimizer) as ``tinker://<model_id>/weights/<name>``."""
        return self._submit("Save", self._save_request(name, "weights", ttl_seconds, overwrite, user_metadata),
                            SaveWeightsResponse)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the adapter for sampling as ``tinker://<model_id>/sampler_weights/<name>``."""
        return self._submit("Save", self._save_request(name, "sampler_weights", ttl_seconds, False, user_metadata),
                            SaveWeightsForSamplerResponse)

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None
                              ) -> APIFuture[SaveWeightsExternalResponse]:
        """Export the adapter as ``tinker://<model_id>/external_weights/<name>``: PEFT files to download
        (``RestClient.get_external_weights_urls``), age-encrypted to the given recipients (1 to 10 public keys),
        expiring after ``ttl_seconds`` (None: never)."""
        request = pb.SaveWeightsExternalRequest(model_id=self.model_id, name=name, ttl_seconds=ttl_seconds,
                                                age_encryption_recipients=age_encryption_recipients or [])
        return self._submit("SaveWeightsExternal", request, SaveWeightsExternalResponse)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: RetryPolicy | None = None,
                                             record_stability_info: bool = False,
                                             kind: SamplingClientKind = "snapshot") -> SamplingClient:
        """Save the adapter for sampling (under ``name``, or an ephemeral name) and bind a client to it.
        ``kind``: ``"snapshot"``, a client pinned to the weights saved now; ``"inflight"`` (unnamed), the weights
        published as this run's inflight weights and a client that follows them: each of its samples runs on the
        run's latest inflight weights when it starts (these or newer), and says which
        (``SampledSequence.policy_version``). Tinker's contract (``SamplingClientKind``), with the version named."""
        return self._conn.spawn(self._save_and_bind(name, retry_config, kind)).result()

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None,
                                                         retry_config: RetryPolicy | None = None,
                                                         record_stability_info: bool = False,
                                                         kind: SamplingClientKind = "snapshot") -> SamplingClient:
        return await asyncio.wrap_future(self._conn.spawn(self._save_and_bind(name, retry_config, kind)))

    async def _save_and_bind(self, name: str | None, retry: RetryPolicy | None, kind: str) -> SamplingClient:
        _check_kind(kind)
        if kind == "snapshot":
            path = (await self.save_weights_for_sampler(*_sampler_name(name))).path
            return await self._sampling_client(path, retry=retry)
        if name is not None:
            raise InvalidArgument(f"kind = 'inflight' publishes unnamed weights: drop name {name!r}, or save a "
                                  "named snapshot")
        name, ttl = _sampler_name(None)
        request = self._save_request(name, "sampler_weights", ttl, False, None)
        request.inflight = True
        await self._submit("Save", request, SaveWeightsForSamplerResponse)
        return await self._sampling_client(follow=self.model_id, retry=retry)

    def create_sampling_client(self, model_path: str, retry_config: RetryPolicy | None = None,
                               record_stability_info: bool = False) -> SamplingClient:
        """A client bound to the sampler checkpoint at ``model_path`` (``tinker://...``) as it is now;
        ``retry_config`` replaces the connection's retry policy for its calls; ``record_stability_info`` as
        ``ServiceClient.create_sampling_client`` says (every sample already carries its record)."""
        return self._conn.spawn(self._sampling_client(model_path, retry=retry_config)).result()

    async def create_sampling_client_async(self, model_path: str, retry_config: RetryPolicy | None = None,
                                           record_stability_info: bool = False) -> SamplingClient:
        return await asyncio.wrap_future(self._conn.spawn(self._sampling_client(model_path, retry=retry_config)))

    def _save_request(self, name: str, kind: str, ttl_seconds: int | None, overwrite: bool,
                      user_metadata: dict[str, str] | None) -> pb.SaveRequest:
        if ttl_seconds is not None and not 0 <= ttl_seconds <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_seconds = {ttl_seconds} must be in [0, {MAX_TTL_S}] (0: keep forever)")
        return pb.SaveRequest(model_id=self.model_id, name=name, kind=kind, ttl_seconds=ttl_seconds or 0,
                              overwrite=overwrite, user_metadata=user_metadata or {})

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[LoadWeightsResponse]:
        """Replace the adapter's weights with a saved state's; the optimizer starts over."""
        return self._load(path, weights_access_token, with_optimizer=False)

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> APIFuture[LoadWeightsResponse]:
        """Replace the adapter's weights and optimizer state with a saved state's."""
        return self._load(path, weights_access_token, with_optimizer=True)

    def _load(self, path: str, weights_access_token: str | None, *, with_optimizer: bool
              ) -> APIFuture[LoadWeightsResponse]:
        check_weights_access_token(weights_access_token)
        request = pb.LoadRequest(model_id=self.model_id, path=path, with_optimizer=with_optimizer)
        return self._submit("Load", request, LoadWeightsResponse)

    def get_info(self) -> GetInfoResponse:
        """The model's base model, tokenizer and LoRA config, fetched when the client was created (as in
        Tinker, this never waits on the server)."""
        return self._info

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (a ``transformers`` tokenizer; see ``lathe.tokenizer``)."""
        return load_tokenizer(self._info.model_data.tokenizer_id or self._info.model_data.model_name)

    # ---- async variants (Tinker's): coroutines returning the same futures ----

    async def forward_async(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                            loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data: Sequence[Datum], loss_fn: str,
                                     loss_fn_config: Mapping[str, float] | None = None
                                     ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def optim_step_async(self, optim_params: AdamParams | None = None, *,
                               adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        return self.optim_step(optim_params, adam_params=adam_params)

    async def save_state_async(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                               user_metadata: dict[str, str] | None = None) -> APIFuture[SaveWeightsResponse]:
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    async def save_weights_for_sampler_async(self, name: str, ttl_seconds: int | None = None,
                                             user_metadata: dict[str, str] | None = None
                                             ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    async def save_weights_external_async(self, name: str, ttl_seconds: int | None = None,
                                          age_encryption_recipients: list[str] | None = None
                                          ) -> APIFuture[SaveWeightsExternalResponse]:
        return self.save_weights_external(name, ttl_seconds, age_encryption_recipients)

    async def load_state_async(self, path: str, weights_access_token: str | None = None
                               ) -> APIFuture[LoadWeightsResponse]:
        return self.load_state(path, weights_access_token)

    async def load_state_with_optimizer_async(self, path: str, weights_access_token: str | None = None
                                              ) -> APIFuture[LoadWeightsResponse]:
        return self.load_state_with_optimizer(path, weights_access_token)

    async def get_info_async(self) -> GetInfoResponse:
        return self._info
