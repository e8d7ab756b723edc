"""``ServiceClient``: the entry point of Lathe's SDK, shaped like Tinker's.

Owns the ``Connection`` to the gateway (see ``lathe.futures``) and the session: created lazily by the first
call that needs one (``CreateSession``, with the client's ``user_metadata`` and ``display_name``), then kept
alive by a heartbeat every ``HEARTBEAT_S`` seconds until ``close(status)``, which records why the session
finished. Creates ``TrainingClient``s (waiting for the model to exist and reading its info) and ``RestClient``s,
which share its connection. Where the gateway is found (arguments, else ``LATHE_BASE_URL`` / ``LATHE_API_KEY``)
is ``lathe.connect``'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

from lathe import info_wire, wire
from lathe.connect import DEFAULT_BASE_URL, grpc_target, open_connection
from lathe.errors import FailedPrecondition, InvalidArgument, LatheError
from lathe.futures import APIFuture, RetryPolicy, call_future, poll
from lathe.loss_trace import LossHandle, trace
from lathe.registry_types import FINISH_STATUSES, FinishStatus
from lathe.rest_client import RestClient
from lathe.sampling_client import SamplingClient
from lathe.training_client import TrainingClient
from lathe.types import (
    CreateModelResponse,
    GetServerCapabilitiesResponse,
    LoraConfig,
    OptimizerConfig,
    check_no_project,
    check_weights_access_token,
    console_page,
    optimizer_family,
)
from lathe.v1 import lathe_pb2 as pb

__all__ = ["DEFAULT_BASE_URL", "HEARTBEAT_S", "ServiceClient", "grpc_target"]

log = logging.getLogger("lathe")

HEARTBEAT_S = 10.0
FINISH_TIMEOUT_S = 10.0  # how long close() tries to have the gateway record the session's status


class ServiceClient:
    """``ServiceClient(base_url, api_key, *, user_metadata)``; use it as a context manager or ``close()`` it.

    ``retry`` sets how long calls that find the gateway UNAVAILABLE are retried (default: up to 120 s each).
    TLS: a ``grpcs://`` (or ``https://``) ``base_url`` or ``tls=True``; ``root_certificates`` (PEM bytes or a
    file path) to trust a private CA (see ``lathe.connect``).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 user_metadata: dict[str, str] | None = None, retry: RetryPolicy | None = None,
                 tls: bool | None = None, root_certificates: bytes | str | Path | None = None,
                 project_id: str | None = None, display_name: str | None = None) -> None:
        """``display_name``: the session's name for people (``RestClient.get_session`` and ``search_sessions``
        answer it). ``project_id``: Tinker's; Lathe has none, so one given is refused."""
        check_no_project("project_id", project_id)
        self._conn = open_connection(base_url, api_key, retry, tls=tls, root_certificates=root_certificates)
        self._user_metadata = dict(user_metadata or {})
        self._display_name = display_name
        # Touched only on the connection's loop:
        self._session: asyncio.Task[str] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._console = ""  # the root of the gateway's web console, from CreateSession

    def __repr__(self) -> str:
        return f"<ServiceClient {self._conn.target}>"

    # ---- session ----

    async def _session_id(self) -> str:
        if self._session is None:
            self._session = asyncio.create_task(self._create_session())
        task = self._session
        try:
            return await asyncio.shield(task)
        except LatheError:
            if self._session is task:
                self._session = None  # the next call tries again
            raise

    async def _create_session(self) -> str:
        resp = await self._conn.call("CreateSession", pb.CreateSessionRequest(user_metadata=self._user_metadata,
                                                                              display_name=self._display_name))
        self._heartbeat = asyncio.create_task(self._beat(resp.session_id))
        self._console = resp.console_url
        return resp.session_id

    def get_console_url(self) -> str:
        """This session's page in the gateway's web console (the session is made now if it is not yet)."""
        session_id = self._run(self._session_id()).result()
        return console_page(self._console, f"sessions/{quote(session_id, safe='')}")

    async def _beat(self, session_id: str) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._conn.call("Heartbeat", pb.HeartbeatRequest(session_id=session_id))
            except FailedPrecondition as e:  # finished: closed, or expired while no heartbeat got through
                log.warning("session %s is over, heartbeats stop: %s", session_id, e)
                return
            except LatheError as e:
                log.warning("heartbeat of session %s failed: %s", session_id, e)

    # ---- training clients ----

    async def _new_training_client(self, rpc: str, request: pb.CreateModelRequest | pb.CreateModelFromStateRequest
                                   ) -> TrainingClient:
        """Submit a model creation, wait for the model to exist, then read its info."""
        request.session_id = await self._session_id()
        submitted = await self._conn.call(rpc, request)
        created = wire.result_from_proto(await poll(self._conn, submitted.request_id), CreateModelResponse)
        info = await self._conn.call("GetInfo", pb.GetInfoRequest(model_id=created.model_id))
        return TrainingClient(self._conn, info_wire.get_info_from_proto(info), self._sampling_client, self._console)

    def _lora(self, base_model: str, rank: int, seed: int | None, train_mlp: bool, train_attn: bool,
              train_unembed: bool, user_metadata: dict[str, str] | None, optimizer: OptimizerConfig | None
              ) -> Coroutine[Any, Any, TrainingClient]:
        family = optimizer_family(optimizer)
        lora = LoraConfig(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                          train_unembed=train_unembed)
        return self._new_training_client("CreateModel", pb.CreateModelRequest(
            base_model=base_model, lora_config=wire.lora_config_to_proto(lora), user_metadata=user_metadata or {},
            optimizer=family))

    async def _from_state(self, path: str, with_optimizer: bool, base_model: str | None,
                          user_metadata: dict[str, str] | None, weights_access_token: str | None,
                          optimizer: OptimizerConfig | None) -> TrainingClient:
        """``base_model`` (Tinker's override of the checkpoint's) must be the checkpoint's own: Lathe knows no
        other model compatible with an adapter."""
        check_weights_access_token(weights_access_token)
        family = optimizer_family(optimizer)
        if base_model is not None:
            run = await self.create_rest_client().get_training_run_by_tinker_path(path)
            if run.base_model != base_model:
                raise InvalidArgument(f"base_model = {base_model!r}, but {path} was trained on {run.base_model!r}; "
                                      "Lathe loads a checkpoint only onto its own base model")
        return await self._new_training_client("CreateModelFromState", pb.CreateModelFromStateRequest(
            path=path, with_optimizer=with_optimizer, user_metadata=user_metadata or {}, optimizer=family))

    def _run(self, work: Coroutine[Any, Any, Any]) -> APIFuture[Any]:
        return call_future(self._conn, work)

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None,
                                    optimizer: OptimizerConfig | None = None) -> TrainingClient:
        """A new LoRA adapter on ``base_model``; returns once the server has created it. ``optimizer``: None
        or ``AdamOptimizerConfig()`` (AdamW), or ``DimuonOptimizerConfig()``; fixed for the run's lifetime."""
        return self._run(self._lora(base_model, rank, seed, train_mlp, train_attn, train_unembed,
                                    user_metadata, optimizer)).result()

    async def create_lora_training_client_async(self, base_model: str, rank: int = 32, seed: int | None = None,
                                                train_mlp: bool = True, train_attn: bool = True,
                                                train_unembed: bool = True,
                                                user_metadata: dict[str, str] | None = None,
                                                optimizer: OptimizerConfig | None = None) -> TrainingClient:
        return await self._run(self._lora(base_model, rank, seed, train_mlp, train_attn, train_unembed,
                                          user_metadata, optimizer))

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: OptimizerConfig | None = None) -> TrainingClient:
        """A new training run starting from the weights saved at ``path``; its optimizer starts over."""
        return self._run(self._from_state(path, False, base_model, user_metadata, weights_access_token,
                                          optimizer)).result()

    async def create_training_client_from_state_async(self, path: str, base_model: str | None = None,
                                                      user_metadata: dict[str, str] | None = None,
                                                      weights_access_token: str | None = None,
                                                      optimizer: OptimizerConfig | None = None
                                                      ) -> TrainingClient:
        return await self._run(self._from_state(path, False, base_model, user_metadata, weights_access_token,
                                                optimizer))

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None
                                                         ) -> TrainingClient:
        """A new training run starting from the weights and optimizer state saved at ``path``."""
        return self._run(self._from_state(path, True, base_model, user_metadata, weights_access_token,
                                          None)).result()

    async def create_training_client_from_state_with_optimizer_async(
            self, path: str, base_model: str | None = None, user_metadata: dict[str, str] | None = None,
            weights_access_token: str | None = None) -> TrainingClient:
        return await self._run(self._from_state(path, True, base_model, user_metadata, weights_access_token, None))

    # ---- sampling clients ----

    async def _sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry: RetryPolicy | None = None, follow: str = "") -> SamplingClient:
        """A client of a new sampling session: pinned to ``model_path`` or ``base_model``, or (``follow``, a
        training run's model id) an inflight client of that run."""
        if not (model_path or base_model or follow):
            raise ValueError("create_sampling_client needs model_path (tinker://...) or base_model")
        session = await self._conn.call("CreateSamplingSession", pb.CreateSamplingSessionRequest(
            session_id=await self._session_id(), model_path=model_path or "", base_model=base_model or "",
            follow_model_id=follow), retry=retry)
        return SamplingClient(self._conn, session, retry)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: RetryPolicy | None = None, record_stability_info: bool = False
                               ) -> SamplingClient:
        """A client bound to the sampler checkpoint at ``model_path`` as it is now, or to ``base_model``;
        ``retry_config`` replaces the connection's retry policy for its calls. ``record_stability_info``
        (Tinker's, for StableReinforce) asks nothing more of Lathe: every sample already returns its record,
        the sampled tokens' logprobs, which the trainer reproduces bit for bit."""
        return self._run(self._sampling_client(model_path, base_model, retry_config)).result()

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           retry_config: RetryPolicy | None = None,
                                           record_stability_info: bool = False) -> SamplingClient:
        return await self._run(self._sampling_client(model_path, base_model, retry_config))

    def create_custom_loss(self, fn: Callable[..., Any], input_ranks: Mapping[str, int]) -> APIFuture[LossHandle]:
        """A custom loss that runs on the server, for ``TrainingClient.forward_backward_custom``.

        ``fn(logprobs, *inputs) -> (loss, metrics)`` runs once per datum (the losses are summed): ``logprobs``
        [T] are the datum's target logprobs, each further parameter the ``loss_fn_inputs`` key of its name;
        metrics are scalar tensors keyed ``custom/<name>:sum`` or ``:mean``. ``input_ranks`` gives each
        parameter's rank (0 scalar, 1 [T], 2 [T, K]; logprobs 1). ``fn`` is traced with torch.fx and checked as
        the server checks it (``lathe.loss_trace``); what cannot run there raises ``InvalidArgument`` here."""
        future: cf.Future[LossHandle] = cf.Future()
        try:
            future.set_result(trace(fn, input_ranks))
        except LatheError as e:
            future.set_exception(e)
        return APIFuture(future)

    # ---- registry ----

    def create_rest_client(self) -> RestClient:
        return RestClient(self._conn)

    def copy_weights(self, path: str, *, ttl_seconds: int | None = None, weights_access_token: str | None = None
                     ) -> APIFuture[str]:
        """``RestClient.copy_weights``: a copy of one of the caller's checkpoints under a run of its own."""
        return self.create_rest_client().copy_weights(path, ttl_seconds=ttl_seconds,
                                                      weights_access_token=weights_access_token)

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The base models this server trains, with their context lengths."""
        return self.create_rest_client().get_server_capabilities().result()

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        return await self.create_rest_client().get_server_capabilities()

    # ---- lifetime ----

    async def _finish(self, status: FinishStatus, detail: str | None) -> None:
        """Record why the session finished, if there is one (none is created for it)."""
        if self._session is None or not self._session.done() or self._session.exception() is not None:
            return
        await self._conn.call("FinishSession", pb.FinishSessionRequest(
            session_id=self._session.result(), status=status, detail=detail or ""), timeout=FINISH_TIMEOUT_S,
            retry=RetryPolicy(max_s=1.0, budget_s=FINISH_TIMEOUT_S))

    def close(self, status: FinishStatus = "success", detail: str | None = None) -> APIFuture[None]:
        """Record the session's final ``status`` (``"success"``, ``"errored"`` or ``"interrupted"``; the first
        one recorded wins; ``detail`` is for people and not kept), then stop the heartbeat, cancel what is in
        flight and close the connection. Idempotent; returns a finished future, as Tinker's does once awaited. A
        status the gateway could not record is logged, and the connection is closed all the same."""
        if status not in FINISH_STATUSES:
            raise InvalidArgument(f"status = {status!r} must be one of {list(FINISH_STATUSES)}")
        done: cf.Future[None] = cf.Future()
        done.set_result(None)
        try:
            self._conn.spawn(self._finish(status, detail)).result()
        except FailedPrecondition:  # closed already
            return APIFuture(done)
        except LatheError as e:
            log.warning("recording the finish of the session failed: %s", e)
        self._conn.close()
        return APIFuture(done)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """As Tinker's: the session finished ``"success"``; ``"errored"`` by an exception, ``"interrupted"`` by
        anything else (Ctrl-C)."""
        if exc_type is None:
            self.close("success")
        else:
            self.close("errored" if issubclass(exc_type, Exception) else "interrupted")
