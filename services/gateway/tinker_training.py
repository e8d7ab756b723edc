"""The Tinker HTTP routes of a training run's operations: create (fresh or from a state), forward_backward (a
``tinker_proto`` body), custom losses, optim_step, save (named, for sampling, or for download) and load.

Each operation answers a future ``{"request_id", "model_id"}`` at once (``tinker_futures`` answers its result). An
ordered operation refused while its body is decoded still passes over its ``seq_id`` (``Runs.refusing``), so the
run's next operations are not held up behind it. State of its own: the tenants' custom losses (``CustomLosses``,
kept in the control store).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from starlette.requests import Request

from lathe.errors import InvalidArgument
from lathe.v1 import lathe_pb2 as pb

from . import tinker_json as tj
from .core import GatewayCore
from .custom_losses import CustomLosses
from .downloads import Downloads, export_note
from .json_fields import INT32_MAX, Fields
from .tinker_io import Bodies
from .tinker_proto import PROTO_CONTENT_TYPE, forward_backward_from_proto, parse_forward_backward


def _future(sub: pb.SubmitResponse) -> dict[str, Any]:
    return {"request_id": sub.request_id, "model_id": sub.model_id or None}


def _load_source(f: Fields) -> tuple[str, bool]:
    """A ``/load_weights`` body's ``path`` and ``optimizer`` (a checkpoint of another account is refused)."""
    if f.get("weights_access_token", str, None) is not None:
        raise InvalidArgument("weights_access_token is not supported: load checkpoints of your own account")
    return f.get("path", str), f.get("optimizer", bool)


class TrainingRoutes:
    """A training run's operations, each answered with a future."""

    def __init__(self, core: GatewayCore, bodies: Bodies) -> None:
        self.core = core
        self.bodies = bodies
        self.custom_losses = CustomLosses(core.store, lambda tenant: core.quotas.of(tenant).max_custom_losses)

    def _refusing(self, tenant: str, f: Fields) -> contextlib.AbstractContextManager[None]:
        """``Runs.refusing`` for the ordered operation whose body is ``f`` (its ids must read)."""
        return self.core.runs.refusing(tenant, f.get("model_id", str), f.get("seq_id", int))

    async def create_model(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.bodies.fields(request)
        return _future(await self.core.runs.create_model(tenant, pb.CreateModelRequest(
            session_id=f.get("session_id", str), base_model=f.get("base_model", str),
            lora_config=tj.lora_config(f.sub("lora_config", required=False)),
            user_metadata=f.strings("user_metadata"), optimizer=tj.optimizer_family(f, "optimizer_config")),
            model_seq_id=f.get("model_seq_id", int)))

    async def get_info(self, request: Request, tenant: str) -> dict[str, Any]:
        model_id = (await self.bodies.fields(request)).get("model_id", str)
        return tj.model_info(await self.core.runs.get_info(tenant, model_id))

    async def forward_backward(self, request: Request, tenant: str) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith(PROTO_CONTENT_TYPE):
            raise InvalidArgument(f"forward_backward takes a {PROTO_CONTENT_TYPE} body (tinker_public."
                                  f"ForwardBackwardRequest), not {content_type or 'no Content-Type'!r}")
        async with self.bodies.read(request) as body:
            msg = parse_forward_backward(body)
            with self.core.runs.refusing(tenant, msg.model_id, msg.seq_id):
                req = forward_backward_from_proto(msg, self.core.limits.max_tensor_elements,
                                                  self.bodies.limits.max_request_tokens)
                if req.loss_fn == "custom":
                    self.custom_losses.resolve(tenant, req)
                if req.loss_fn == "stable_reinforce":  # its behaviour logprobs are the record's
                    self.core.stability.resolve(tenant, msg, req)
        return _future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, forward_backward=req))

    async def create_custom_loss(self, request: Request, tenant: str) -> dict[str, Any]:
        """Check and keep a traced loss (``custom_losses``); the future answers its ``loss_id`` at once."""
        f = await self.bodies.fields(request)
        session_id = f.get("session_id", str)
        self.core.book.get(tenant, session_id)
        inputs = [Fields(x, f"{f.path('inputs')}[{i}]") for i, x in enumerate(f.get("inputs", list))]
        loss = pb.CustomLoss(name=f.get("name", str), graph_json=json.dumps(f.get("graph", dict)), inputs=[
            pb.CustomLossInput(name=x.get("name", str), rank=x.get("rank", int, int_max=INT32_MAX)) for x in inputs])
        loss_id = self.custom_losses.create(tenant, session_id, f.get("custom_loss_seq_id", int), loss)
        result = pb.FutureResult(custom_loss=pb.CustomLossOutput(loss_id=loss_id))
        return {"request_id": self.core.ledger.answered(tenant, result), "model_id": None}

    async def optim_step(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.bodies.fields(request)
        with self._refusing(tenant, f):
            req = tj.optim_step(f)
        return _future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, optim_step=req))

    async def save_weights(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.bodies.fields(request)
        with self._refusing(tenant, f):
            req = pb.SaveRequest(model_id=f.get("model_id", str), seq_id=f.get("seq_id", int),
                                 name=f.get("path", str), kind="weights", ttl_seconds=f.get("ttl_seconds", int, 0),
                                 overwrite=f.get("overwrite", bool, False), user_metadata=f.strings("user_metadata"))
        return _future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, save=req))

    async def save_weights_for_sampler(self, request: Request, tenant: str) -> dict[str, Any]:
        """Named: a sampler checkpoint. Unnamed (``save_weights_and_get_sampling_client``): an ephemeral
        one, answered with the sampling session bound to it."""
        f = await self.bodies.fields(request)
        model_id, seq_id = f.get("model_id", str), f.get("seq_id", int)
        with self._refusing(tenant, f):
            name = f.get("path", str, "")
            inflight = tj.sampling_kind(f) == "inflight"
            if name and inflight:
                raise InvalidArgument(f"{f.path('kind')} = 'inflight' publishes unnamed weights: drop path "
                                      f"{name!r}, or save a named snapshot")
            if name:
                req = pb.SaveRequest(model_id=model_id, seq_id=seq_id, name=name, kind="sampler_weights",
                                     ttl_seconds=f.get("ttl_seconds", int, 0),
                                     user_metadata=f.strings("user_metadata"))
            else:
                sampling_seq_id = f.get("sampling_session_seq_id", int)
        if name:
            return _future(await self.core.runs.submit(tenant, model_id, seq_id, save=req))
        return _future(self.core.runs.save_for_sampling(tenant, model_id, seq_id, sampling_seq_id, inflight))

    async def save_weights_external(self, request: Request, tenant: str) -> dict[str, Any]:
        """A sampler snapshot of the run, turned into ``tinker://<run>/external_weights/<name>`` when its future
        is retrieved (``downloads.py``)."""
        f = await self.bodies.fields(request)
        model_id, seq_id = f.get("model_id", str), f.get("seq_id", int)
        with self._refusing(tenant, f):
            note = export_note(f.get("age_encryption_recipients", list, None), f.get("path", str),
                               f.get("ttl_seconds", int, None))
        sub = await self.core.runs.submit(tenant, model_id, seq_id, save=Downloads.staging_save(model_id, seq_id, note))
        return _future(sub)

    async def load_weights(self, request: Request, tenant: str) -> dict[str, Any]:
        """With ``session_id``: a new training run loaded from ``path`` (create_training_client_from_state*).
        Otherwise the legacy form: a load into ``model_id`` at ``seq_id`` (load_state*)."""
        f = await self.bodies.fields(request)
        if f.get("session_id", str, None) is None:
            with self._refusing(tenant, f):
                path, with_optimizer = _load_source(f)
                req = pb.LoadRequest(model_id=f.get("model_id", str), seq_id=f.get("seq_id", int), path=path,
                                     with_optimizer=with_optimizer)
            return _future(await self.core.runs.submit(tenant, req.model_id, req.seq_id, load=req))
        path, with_optimizer = _load_source(f)
        return _future(await self.core.runs.create_model_from_state(
            tenant, pb.CreateModelFromStateRequest(session_id=f.get("session_id", str), path=path,
                                                   with_optimizer=with_optimizer,
                                                   user_metadata=f.strings("user_metadata"),
                                                   optimizer=tj.optimizer_family(f, "optimizer_config")),
            model_seq_id=f.get("model_seq_id", int), base_model=f.get("base_model", str, "")))
