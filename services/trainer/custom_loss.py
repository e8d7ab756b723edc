"""Custom losses (tinker's ``create_custom_loss``): a checked ``lathe.loss_graph.LossGraph`` run per datum.

The graph's vocabulary and rules are ``lathe.loss_graph``'s; this module owns what each name computes
(``FUNCTION_IMPLS``; a method name is the ``torch.Tensor`` method of that name) and the evaluation:

    CustomLoss(graph)(lp, inputs) -> (loss, metrics)
      lp: [T] fp32 logprobs of the datum's target tokens (with autograd); inputs: the datum's loss_fn_inputs
      by name, fp32 of the declared rank ([], [T] or [T, K]); loss: [] ; metrics: name -> [] (detached)

Each call node is evaluated once, in order, on the trainer's device and in fp32 (constants are Python
numbers, so torch's type promotion keeps fp32). A job's loss is the sum of its datums' losses (as for the
built-in losses); its metrics are summed over datums and ``reduce_metrics`` divides the ``:mean`` ones by the
number of datums, as tinker's SDK combines them client-side.

Budgets, all checked before anything is computed (``plan`` for a job's datums, then each call per datum): every
node's shape comes from ``lathe.loss_shapes.infer_shapes`` (at most ``MAX_NODE_ELEMENTS`` elements per node); over a
job's datums, the nodes' elements (which autograd keeps until the backward) add up to at most the pool's
``LossBudget.elements`` and the node evaluations to at most its ``LossBudget.calls`` (``MAX_LOSS_ELEMENTS`` and
``MAX_LOSS_CALLS`` by default, the trainer's ``--max-loss-elements`` and ``--max-loss-calls``); the cycle planner
(``lathe.trainer.cycle``) holds all the jobs of one cycle together to the element budget too (``elements``). Every
call is a torch op on a tensor of known size, linear in its elements, so these bound a job's time and memory; no
Python arithmetic runs on client values (the checker sees to it). Whatever a node raises (a torch error,
MemoryError, ...) fails its job with ``InvalidArgument`` naming the node; a result whose shape is not the inferred
one fails it with ``Internal``.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lathe.errors import Internal, InvalidArgument
from lathe.loss_graph import FUNCTIONS, LossGraph, Ref
from lathe.loss_shapes import Shape, infer_shapes

MAX_LOSS_ELEMENTS = 2**26  # default: elements of all nodes over a job's datums, and a cycle's (256 MiB in fp32)
MAX_LOSS_CALLS = 2**15  # default: node evaluations over a job's datums (datums x calls)
_CACHED_SHAPES = 256  # input shapes whose node shapes a CustomLoss remembers

FUNCTION_IMPLS: dict[str, Any] = {
    **{name: getattr(operator, name.removeprefix("operator.")) for name in FUNCTIONS
       if name.startswith("operator.")},
    **{name: getattr(torch, name.removeprefix("torch.")) for name in FUNCTIONS
       if name.startswith("torch.") and not name.startswith("torch._C.")},
    "torch._C._nn.log_sigmoid": F.logsigmoid,
    "torch._C._nn.softplus": F.softplus,
}


def _resolve(value: Any, env: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class LossBudget:
    """A pool's budgets for custom losses (the trainer's ``--max-loss-elements`` and ``--max-loss-calls``)."""

    elements: int = MAX_LOSS_ELEMENTS
    """elements of a custom loss's nodes over one pass's datums, and over one cycle's jobs"""
    calls: int = MAX_LOSS_CALLS
    """custom-loss node evaluations over one pass's datums (datums x nodes)"""

    def __post_init__(self) -> None:
        if type(self.elements) is not int or type(self.calls) is not int or self.elements < 1 or self.calls < 1:
            raise ValueError(f"custom-loss budgets must be integers >= 1, got elements={self.elements!r} and "
                             f"calls={self.calls!r}")


@dataclass(frozen=True, slots=True)
class CustomLoss:
    """A checked graph, callable per datum, under ``budget`` (see the module docstring)."""

    graph: LossGraph
    budget: LossBudget = LossBudget()
    _shapes: dict[tuple[Shape, ...], dict[str, Shape]] = field(default_factory=dict, compare=False, repr=False)

    def shapes(self, length: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, Shape]:
        """Every node's shape for a datum of ``length`` target tokens with these ``inputs`` (remembered)."""
        key = ((length,), *(tuple(inputs[n].shape) for n in self.graph.input_names))
        found = self._shapes.get(key)
        if found is None:
            if len(self._shapes) >= _CACHED_SHAPES:
                self._shapes.clear()
            found = self._shapes[key] = infer_shapes(self.graph, key)
        return found

    def elements(self, datums: Sequence[tuple[int, Mapping[str, torch.Tensor]]]) -> int:
        """The elements this loss's nodes hold over ``datums`` ``(length, inputs)``, counted up to just past
        the element budget, for the cycle planner. Datums that ``plan`` refuses count 0 (over the call budget:
        none is sized; a datum whose shapes are refused): ``plan`` then refuses them by name."""
        total = 0
        if len(datums) * len(self.graph.calls) > self.budget.calls:
            return total
        for length, inputs in datums:
            with contextlib.suppress(InvalidArgument):
                total += self._elements(self.shapes(length, inputs))
            if total > self.budget.elements:
                break
        return total

    def _elements(self, shapes: dict[str, Shape]) -> int:
        return sum(math.prod(shapes[node.name]) for node in self.graph.calls)

    def plan(self, datums: Sequence[tuple[int, Mapping[str, torch.Tensor]]]) -> None:
        """Refuse a job whose datums ``(length, inputs)`` would take this loss over a budget, naming the datum
        and node or the budget, before any of them is evaluated."""
        g, elements = self.graph, 0
        calls = len(datums) * len(g.calls)
        if calls > self.budget.calls:
            raise InvalidArgument(f"custom loss {g.name!r}: {len(datums)} datums x {len(g.calls)} calls = {calls} "
                                  f"node evaluations, over the limit of {self.budget.calls} per pass (a cycle's "
                                  "share of a request); send fewer datums per request")
        for i, (length, inputs) in enumerate(datums):
            try:
                shapes = self.shapes(length, inputs)
            except InvalidArgument as e:
                raise InvalidArgument(f"datum {i}: {e.message}") from None
            elements += self._elements(shapes)
            if elements > self.budget.elements:
                raise InvalidArgument(f"custom loss {g.name!r}: datums 0-{i} make {elements} elements in its "
                                      f"nodes, over the limit of {self.budget.elements} per pass (a cycle's share of "
                                      "a request); send fewer or shorter datums per request")

    def __call__(self, lp: torch.Tensor, inputs: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = self.graph
        shapes = self.shapes(len(lp), inputs)
        env = dict(zip(g.params, [lp, *(inputs[n] for n in g.input_names)], strict=True))
        for node in g.calls:
            args = _resolve(node.args, env)
            kwargs = {k: _resolve(v, env) for k, v in node.kwargs.items()}
            try:
                if node.op == "call_function":
                    out = FUNCTION_IMPLS[node.target](*args, **kwargs)
                else:
                    out = getattr(args[0], node.target)(*args[1:], **kwargs)
            except Exception as e:  # noqa: BLE001 - whatever a node raises fails this loss alone, named
                raise InvalidArgument(f"custom loss {g.name!r}: node {node.name} ({node.target}) failed: "
                                      f"{type(e).__name__}: {e}") from None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != shapes[node.name]:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise Internal(f"custom loss {g.name!r}: node {node.name} ({node.target}) made {got}, not the "
                               f"inferred shape {shapes[node.name]}")
            env[node.name] = out
        return env[g.loss], {key: env[name].detach().reshape(()) for key, name in g.metrics.items()}


def reduce_metrics(sums: dict[str, float], datums: int) -> dict[str, float]:
    """Per-datum metric sums as the request's metrics: ``:mean`` ones divided by the number of datums."""
    return {k: v / datums if k.endswith(":mean") else v for k, v in sums.items()}
