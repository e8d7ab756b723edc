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
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lathe.errors import InvalidArgument
from lathe.loss_graph import FUNCTIONS, LossGraph, Ref

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
class CustomLoss:
    """A checked graph, callable per datum (see the module docstring)."""

    graph: LossGraph

    def __call__(self, lp: torch.Tensor, inputs: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = self.graph
        env = dict(zip(g.params, [lp, *(inputs[n] for n in g.input_names)], strict=True))
        for node in g.calls:
            args = _resolve(node.args, env)
            kwargs = {k: _resolve(v, env) for k, v in node.kwargs.items()}
            try:
                if node.op == "call_function":
                    out = FUNCTION_IMPLS[node.target](*args, **kwargs)
                else:
                    out = getattr(args[0], node.target)(*args[1:], **kwargs)
            except (RuntimeError, TypeError, IndexError, ValueError) as e:
                raise InvalidArgument(f"custom loss {g.name!r}: node {node.name} ({node.target}) failed: {e}") from None
            env[node.name] = out
        loss = env[g.loss]
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InvalidArgument(f"custom loss {g.name!r} must return a scalar loss, got {shape} from node {g.loss}")
        metrics = {}
        for key, name in g.metrics.items():
            value = env[name]
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise InvalidArgument(f"custom loss {g.name!r}: metric {key!r} (node {name}) is not a scalar")
            metrics[key] = value.detach().reshape(())
        return loss, metrics


def reduce_metrics(sums: dict[str, float], datums: int) -> dict[str, float]:
    """Per-datum metric sums as the request's metrics: ``:mean`` ones divided by the number of datums."""
    return {k: v / datums if k.endswith(":mean") else v for k, v in sums.items()}
