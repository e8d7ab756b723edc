"""The Tinker HTTP routes of sampling and of the futures every model operation answers.

Sampling: sampling sessions (create, join, get) and ``/asample``. Futures: ``/retrieve_future`` long-polls the
core's ledger and answers the result (protobuf for forward/backward and sampling outputs, JSON otherwise),
``{"type": "try_again"}`` when nothing came within the wait, or ``{"error", "category"}`` when the operation failed;
its ``queue_state`` says whether a full trainer queue or one of the tenant's own quotas holds new work back
(``GatewayCore.queue_state``). ``/retrieve_futures`` long-polls a sampling client's completion queue
(``completions``), which the SDK then fetches one by one; ``/cancel_future`` cancels a sample.

State of its own: only what an HTTP request said that its result does not carry (the layout of a sample's sparse
``target_prompt_logprobs``), kept by request id for the latest requests; a gateway restart forgets it, and the
result is then answered dense.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lathe.errors import InvalidArgument
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import tinker_public_pb2 as tp

from . import tinker_json as tj
from .core import GatewayCore
from .downloads import Downloads
from .futures import KEEP_DONE
from .ledger import MAX_WAIT_S
from .tinker_io import Bodies
from .tinker_proto import PROTO_CONTENT_TYPE, forward_backward_output_to_proto, sample_response_to_proto

POLL_MARGIN_S = 15.0  # a long-poll ends this long before the client's read timeout (its x-stainless header)


@dataclass(frozen=True, slots=True)
class _Note:
    """What the HTTP request said that its result does not carry."""

    target_layout: tp.SparseCsr | None = None  # a sample's sparse target_prompt_logprobs: the cells to answer


def _poll_s(request: Request) -> float:
    """How long a long-poll may hold: until shortly before the client's read timeout."""
    try:
        return max(1.0, float(request.headers.get("x-stainless-read-timeout", "")) - POLL_MARGIN_S)
    except ValueError:
        return MAX_WAIT_S


def _result(res: pb.FutureResult, note: _Note) -> Response | dict[str, Any]:
    kind = res.WhichOneof("result")
    if kind == "error":
        return {"error": res.error.message, "category": res.error.category or "unknown"}
    if kind == "forward_backward":
        return Response(forward_backward_output_to_proto(res.forward_backward), media_type=PROTO_CONTENT_TYPE)
    if kind == "sample":
        return Response(sample_response_to_proto(res.sample, note.target_layout), media_type=PROTO_CONTENT_TYPE)
    if kind == "create_model":
        return {"model_id": res.create_model.model_id}
    if kind == "custom_loss":
        return {"type": "create_custom_loss", "loss_id": res.custom_loss.loss_id}
    if kind == "optim_step":
        return {"metrics": dict(res.optim_step.metrics)}
    if kind == "save":
        return {"path": res.save.path, "sampling_session_id": res.save.sampling_session_id or None}
    return {"path": res.load.path, "model_id": res.load.model_id}


class FutureRoutes:
    """Sampling sessions, samples and the futures' long polls."""

    def __init__(self, core: GatewayCore, bodies: Bodies, downloads: Downloads) -> None:
        """``downloads``: finishes a ``save_weights_external`` when its future is retrieved."""
        self.core = core
        self.bodies = bodies
        self.downloads = downloads
        self._notes: OrderedDict[str, _Note] = OrderedDict()

    def _note(self, request_id: str, note: _Note) -> None:
        self._notes[request_id] = note
        while len(self._notes) > KEEP_DONE:
            self._notes.popitem(last=False)

    # ---- sampling ----

    async def create_sampling_session(self, request: Request, tenant: str) -> dict[str, Any]:
        f = await self.bodies.fields(request)
        session = await self.core.sampling.create_session(tenant, pb.CreateSamplingSessionRequest(
            session_id=f.get("session_id", str), model_path=f.get("model_path", str, ""),
            base_model=f.get("base_model", str, "")), seq_id=f.get("sampling_session_seq_id", int))
        return {"type": "create_sampling_session", "sampling_session_id": session.sampling_session_id}

    async def join_sampling_session(self, request: Request, tenant: str) -> dict[str, Any]:
        sid = (await self.bodies.fields(request)).get("sampling_session_id", str)
        return {"type": "join_sampling_session", "client_counter": self.core.sampling.join(tenant, sid)}

    async def get_sampler(self, request: Request, tenant: str) -> dict[str, Any]:
        s = self.core.sampling.get(tenant, request.path_params["sampling_session_id"])
        return {"sampler_id": s.sampling_session_id, "base_model": s.base_model, "model_path": s.model_path or None}

    async def asample(self, request: Request, tenant: str) -> dict[str, Any]:
        req, layout = tj.sample_request(await self.bodies.fields(request), self.core.limits.max_tensor_elements)
        sub = await self.core.sampling.sample(tenant, req)
        if layout is not None:
            self._note(sub.request_id, _Note(target_layout=layout))
        return {"request_id": sub.request_id,
                "sample_sequence_ids": [f"{sub.request_id}:{i}" for i in range(req.num_samples)]}

    # ---- futures ----

    async def retrieve_future(self, request: Request, tenant: str) -> Response | dict[str, Any]:
        request_id = (await self.bodies.fields(request)).get("request_id", str)
        res = await self.core.ledger.retrieve(tenant, request_id, _poll_s(request))
        if not res.done:
            return {"type": "try_again", "request_id": request_id, "queue_state": res.queue_state,
                    "queue_state_reason": res.queue_state_reason or None}
        if res.WhichOneof("result") == "save" and Downloads.maybe_staging(res.save.path):
            exported = await self.downloads.finish_export(tenant, res.save.path)  # a save_weights_external
            if exported is not None:
                return exported
        return _result(res, self._notes.get(request_id, _Note()))

    async def retrieve_futures(self, request: Request, tenant: str) -> dict[str, Any]:
        """The samples of one sampling client finished since ``prev_cursor``; ``timeout`` 0 answers at once.
        ``retrieved_request_ids`` is accepted and not needed: results stay as long as the core keeps them."""
        f = await self.bodies.fields(request)
        target = f.sub("target")
        kind = target.get("type", str, "sampling_session")
        if kind != "sampling_session":
            raise InvalidArgument(f"{target.path('type')} = {kind!r}: only 'sampling_session' targets are served")
        timeout = f.get("timeout", float, None)
        events, cursor = await self.core.sampling.completed(
            tenant, target.get("sampling_session_id", str), target.get("cloned_sampler_id", int, 0),
            f.get("prev_cursor", int, 0), _poll_s(request) if timeout is None else max(0.0, timeout))
        return {"completions": [{"state": "failed" if e.failed else "finished", "request_id": e.request_id}
                                for e in events], "cursor": cursor}

    async def cancel_future(self, request: Request, tenant: str) -> dict[str, Any]:
        """Cancel a sample not finished yet (``Ledger.cancel``); one already finished keeps its result."""
        request_id = (await self.bodies.fields(request)).get("request_id", str)
        return {"request_id": request_id, "cancelled": self.core.ledger.cancel(tenant, request_id)}
