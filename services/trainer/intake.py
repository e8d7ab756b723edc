"""The trainer's intake: ``pb.TrainerOp`` in, decoded and checked once, ``pb.TrainerResult`` out.

``submit`` is what ``Trainer.Run`` does before it waits: it reads the run's ``Limits`` from the engine, decodes
the request into a plain ``Op`` (``decode_op``: every datum checked against the run's base model, a custom
loss's graph checked by ``lathe.loss_graph``, the optimizer's hyperparameters and the save kind checked) and
queues it. All of it runs on the caller's thread, outside the engine's lock; the engine and its cycle only ever
see ``lathe.trainer.ops`` values.

A request that fails its checks is refused alone, before it is queued: it becomes a ``Skip`` carrying its
error, answered at once, and its ``seq_id`` is passed over as soon as a later one waits (as one the gateway
refused at its door), so it never holds the run's later operations. ``result_to_proto`` writes a ``Result``
back as the gateway reads it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from lathe.errors import Internal, InvalidArgument, LatheError
from lathe.loss_graph import check_graph
from lathe.trainer.custom_loss import CustomLoss
from lathe.trainer.ops import (
    SAVE_KINDS,
    Body,
    ForwardBackward,
    Limits,
    Load,
    Op,
    OptimStep,
    Result,
    Save,
    Skip,
)
from lathe.trainer.validate import check_request
from lathe.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import error_to_proto, forward_backward_output_to_proto, optim_params_from_proto, receipt_to_proto

if TYPE_CHECKING:
    from lathe.trainer.engine import TrainerEngine


def submit(engine: TrainerEngine, msg: pb.TrainerOp) -> Future[Result]:
    """Decode and check ``msg`` with its run's limits and queue it; raises what ``engine.submit`` raises."""
    return engine.submit(decode_op(msg, engine.limits(msg.model_id)))


def decode_op(msg: pb.TrainerOp, limits: Limits) -> Op:
    """``msg`` as a plain ``Op``; a body that fails its checks (or trips over a bug) becomes a ``Skip`` with
    the error that names the field and value at fault."""
    try:
        body = _body(msg, limits)
    except LatheError as e:
        body = Skip(e)
    except Exception as e:  # noqa: BLE001 - one request's failure: it is answered alone
        body = Skip(Internal(f"checking seq_id {msg.seq_id} failed: {type(e).__name__}: {e}"))
    return Op(msg.model_id, msg.seq_id, msg.request_id, msg.tenant, body)


def _body(msg: pb.TrainerOp, limits: Limits) -> Body:
    kind = msg.WhichOneof("op")
    if kind == "forward_backward":
        req = msg.forward_backward
        graph = None
        if req.loss_fn == "custom":
            c = req.custom_loss
            graph = check_graph(c.name, [(x.name, x.rank) for x in c.inputs], c.graph_json)
        examples, cfg = check_request(req.data, req.loss_fn, dict(req.loss_fn_config), limits, graph)
        return ForwardBackward(examples, req.loss_fn, cfg, backward=not req.forward_only,
                               custom=None if graph is None else CustomLoss(graph, limits.loss_budget))
    if kind == "optim_step":
        return OptimStep(optim_params_from_proto(msg.optim_step).check())
    if kind == "save":
        req = msg.save
        if req.kind not in SAVE_KINDS:
            raise InvalidArgument(f"save kind {req.kind!r} must be 'weights' or 'sampler_weights'")
        return Save(req.kind, req.name, req.ttl_seconds, req.overwrite, dict(req.user_metadata),
                    msg.max_checkpoint_bytes)
    if kind == "load":
        return Load(msg.load.path, msg.load.with_optimizer)
    if kind == "skip":
        return Skip(InvalidArgument(f"seq_id {msg.seq_id} was refused by the gateway: {msg.skip.reason}"))
    raise InvalidArgument(f"TrainerOp seq_id {msg.seq_id} has no operation: one of forward_backward, optim_step, "
                          "save, load or skip is needed")


def result_to_proto(res: Result) -> pb.TrainerResult:
    msg = pb.TrainerResult()
    if res.receipt is not None:
        msg.receipt.CopyFrom(receipt_to_proto(res.receipt))
        if res.recovery_path:
            msg.receipt.recovery_path = res.recovery_path
            msg.receipt.recovery_seq_id = res.receipt.seq_id
    out = res.output
    if res.error is not None:
        msg.error.CopyFrom(error_to_proto(res.error))
    elif isinstance(out, ForwardBackwardOutput):
        msg.forward_backward.CopyFrom(forward_backward_output_to_proto(out))
    elif isinstance(out, OptimStepResponse):
        msg.optim_step.CopyFrom(pb.OptimStepOutput(metrics=out.metrics or {}))
    elif isinstance(out, SaveWeightsResponse | SaveWeightsForSamplerResponse):
        msg.save.CopyFrom(pb.SaveOutput(path=out.path))
    elif isinstance(out, LoadWeightsResponse):
        msg.load.CopyFrom(pb.LoadOutput(path=out.path or "", model_id=out.model_id or ""))
    else:
        raise TypeError(f"a trainer result holds neither an error nor an output: {res!r}")
    return msg
