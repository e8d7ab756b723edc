"""Custom losses that run on the server: ``ServiceClient.create_custom_loss`` traces, encodes and checks them.

A per-datum loss ``fn(logprobs, *inputs) -> (loss, {"custom/<name>:sum|mean": tensor})`` is traced with
``torch.fx`` (imported here, when a user asks) into tinker's ``CustomLossGraph`` JSON (format 1: one object per
node with op, name, target, args, kwargs; arguments encoded as that format says: ``{"ref": node}``,
``{"tuple": [...]}``, ``{"slice": [start, stop, step]}``, ``{"ellipsis": true}``, ``{"float": "inf"}`` ...),
then checked by ``lathe.loss_graph.check_graph``, the same check the server makes, so a loss the server would
refuse fails here, naming its node. The ``LossHandle`` holds the JSON; ``TrainingClient.forward_backward_custom``
sends it inline with every request (``loss_fn="custom"``), one forward_backward and no client-side pass.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lathe.errors import InvalidArgument
from lathe.loss_graph import check_graph
from lathe.v1 import lathe_pb2 as pb


@dataclass(frozen=True, slots=True)
class LossHandle:
    """A traced custom loss: pass it to ``TrainingClient.forward_backward_custom`` in place of a callable."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank): logprobs first, then the loss_fn_inputs keys it reads
    graph_json: str

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.inputs[1:])

    def to_proto(self) -> pb.CustomLoss:
        return pb.CustomLoss(name=self.name, graph_json=self.graph_json,
                             inputs=[pb.CustomLossInput(name=n, rank=r) for n, r in self.inputs])


def _qualified(fn: Any) -> str:
    """A called function's wire name: ``module.name`` (Python's operators as ``operator.<name>``)."""
    module = getattr(fn, "__module__", None) or ""
    if module == "_operator":
        module = "operator"
    return f"{module}.{getattr(fn, '__name__', repr(fn))}"


def _encode(value: Any) -> Any:
    import torch.fx

    if isinstance(value, torch.fx.Node):
        return {"ref": value.name}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): _encode(v) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise InvalidArgument(f"create_custom_loss: an argument of type {type(value).__name__} cannot be sent")


def encode(module: Any) -> str:
    """The nodes of a ``torch.fx.GraphModule`` as ``CustomLossGraph`` JSON."""
    nodes = []
    for node in module.graph.nodes:
        target = _qualified(node.target) if node.op == "call_function" else str(node.target)
        nodes.append({"op": node.op, "name": node.name, "target": target,
                      "args": [_encode(a) for a in node.args],
                      "kwargs": {k: _encode(v) for k, v in node.kwargs.items()}})
    return json.dumps({"format": 1, "nodes": nodes})


def trace(fn: Callable[..., Any], input_ranks: Mapping[str, int]) -> LossHandle:
    """``fn`` traced, encoded and checked; ``input_ranks`` gives each parameter's rank, logprobs included."""
    import torch.fx

    name = getattr(fn, "__name__", type(fn).__name__)
    params = list(inspect.signature(fn).parameters)
    if set(params) != set(input_ranks):
        raise InvalidArgument(f"create_custom_loss: input_ranks must give a rank for each parameter of {name} "
                              f"({', '.join(params)}), got {sorted(input_ranks)}")
    try:
        module = torch.fx.symbolic_trace(fn)
    except Exception as e:  # noqa: BLE001 - any tracing failure is the loss's: said with its cause
        raise InvalidArgument(f"create_custom_loss: {name} cannot be traced by torch.fx: {e}") from None
    inputs = [(p, int(input_ranks[p])) for p in params]
    graph_json = encode(module)
    check_graph(name, inputs, graph_json)
    return LossHandle(name, tuple(inputs), graph_json)
