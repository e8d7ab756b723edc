"""Custom loss graphs (tinker's ``create_custom_loss``) as checked data: the vocabulary and the limits.

A client traces its per-datum loss ``fn(logprobs, *inputs) -> (loss, metrics)`` with ``torch.fx`` and sends the
nodes as JSON (tinker's ``CustomLossGraph``, format 1). ``check_graph`` turns that JSON into a ``LossGraph``
or refuses it with ``InvalidArgument`` naming the node and what is wrong with it. Who uses it: the Tinker HTTP
door when a loss is created (so a bad graph fails at ``create_custom_loss``, not at the first step) and the
trainer (``lathe.trainer.custom_loss``) before it evaluates a graph. This module never imports torch: it owns
the names a graph may call (``FUNCTIONS``, ``METHODS``, with the keyword arguments each accepts) and the
trainer owns what each name computes; a test keeps the two tables equal.

What a graph may be:

    nodes      at most MAX_NODES, names unique; placeholders first, one per declared input, in order
    ops        placeholder | call_function (a FUNCTIONS target) | call_method (a METHODS name) | output (last)
    arguments  earlier nodes ({"ref": name}), numbers (and {"float": "inf" | "-inf" | "nan"}), booleans, None,
               lists and tuples of these, slices and Ellipsis (indexing); no strings, dtypes or devices
    depth      the longest chain of calls from an input to the output is at most MAX_DEPTH
    output     (loss, {metric: node}) with metric keys custom/<name>:sum or custom/<name>:mean
    inputs     logprobs first, with rank 1 ([T]: Lathe's trainer computes the target tokens' logprobs only);
               then at most MAX_INPUTS - 1 loss_fn_inputs keys of rank 0 (scalar), 1 ([T]) or 2 ([T, K])
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from lathe.errors import InvalidArgument

MAX_NODES = 512
MAX_DEPTH = 128
MAX_INPUTS = 16  # logprobs included (tinker's own limit)
MAX_GRAPH_BYTES = 256 * 1024

_REDUCE = frozenset({"dim", "keepdim"})
_CLAMP = frozenset({"min", "max"})
# call_function targets (as tinker's SDK names them on the wire) -> the keyword arguments each accepts
FUNCTIONS: dict[str, frozenset[str]] = {
    **{f"operator.{op}": frozenset() for op in (
        "add", "sub", "mul", "truediv", "neg", "pow", "abs", "getitem", "gt", "ge", "lt", "le", "eq", "ne")},
    **{f"torch.{fn}": frozenset() for fn in (
        "exp", "log", "log1p", "expm1", "abs", "sqrt", "square", "sigmoid", "tanh", "minimum", "maximum", "where",
        "neg")},
    "torch.clamp": _CLAMP,
    "torch.sum": _REDUCE,
    "torch.mean": _REDUCE,
    "torch.logsumexp": _REDUCE,
    "torch.softmax": frozenset({"dim"}),
    "torch.log_softmax": frozenset({"dim"}),
    "torch._C._nn.log_sigmoid": frozenset(),  # torch.nn.functional.logsigmoid
    "torch._C._nn.softplus": frozenset({"beta", "threshold"}),  # torch.nn.functional.softplus
    "torch.relu": frozenset(),
}
# call_method names (torch.Tensor methods) -> the keyword arguments each accepts
METHODS: dict[str, frozenset[str]] = {
    **{m: frozenset() for m in (
        "exp", "log", "log1p", "expm1", "abs", "sqrt", "square", "sigmoid", "tanh", "neg", "relu", "detach",
        "float", "pow")},
    "clamp": _CLAMP,
    "clip": _CLAMP,
    "sum": _REDUCE,
    "mean": _REDUCE,
    "logsumexp": _REDUCE,
    "softmax": frozenset({"dim"}),
    "log_softmax": frozenset({"dim"}),
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True, slots=True)
class Ref:
    """An argument that is an earlier node's value."""

    name: str


@dataclass(frozen=True, slots=True)
class Node:
    """One call: ``op`` is ``call_function`` or ``call_method`` (a method's object is ``args[0]``)."""

    name: str
    op: str
    target: str
    args: tuple[Any, ...]  # decoded: Ref, numbers, bools, None, tuples/lists of these, slice, Ellipsis
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LossGraph:
    """A checked graph: its inputs ``(name, rank)`` in parameter order (logprobs first), its calls in execution
    order, and which node is the loss and which the metrics."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    params: tuple[str, ...]  # the placeholder node of each input, in the same order
    calls: tuple[Node, ...]
    loss: str
    metrics: dict[str, str]  # custom/<name>:<sum|mean> -> node name

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads (every input but logprobs)."""
        return tuple(n for n, _ in self.inputs[1:])


def check_inputs(name: str, inputs: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The declared inputs, checked: logprobs first with rank 1, then distinct lowercase names of rank 0-2."""
    where = f"custom loss {name!r}"
    if not inputs or inputs[0][0] != "logprobs":
        raise InvalidArgument(f"{where}: inputs must start with 'logprobs', got {[n for n, _ in inputs][:4]}")
    if inputs[0][1] != 1:
        raise InvalidArgument(f"{where}: logprobs has rank {inputs[0][1]}; Lathe serves rank 1 ([T]: the target "
                              "tokens' logprobs) only")
    if len(inputs) > MAX_INPUTS:
        raise InvalidArgument(f"{where}: {len(inputs)} inputs, over the limit of {MAX_INPUTS} (logprobs included)")
    seen: set[str] = set()
    for i, (n, rank) in enumerate(inputs):
        if not _INPUT_NAME.fullmatch(n) or n in seen:
            raise InvalidArgument(f"{where}: inputs[{i}].name = {n[:80]!r} must be a new lowercase identifier")
        if rank not in (0, 1, 2):
            raise InvalidArgument(f"{where}: inputs[{i}] ({n}) has rank {rank}; ranks are 0, 1 or 2")
        if n == "target_tokens":
            raise InvalidArgument(f"{where}: inputs[{i}] may not be target_tokens (logprobs stands for them)")
        seen.add(n)
    return tuple(inputs)


def check_graph(name: str, inputs: list[tuple[str, int]], graph_json: str) -> LossGraph:
    """``graph_json`` (tinker's ``CustomLossGraph``) as a ``LossGraph`` once every rule above holds."""
    if len(graph_json) > MAX_GRAPH_BYTES:
        raise InvalidArgument(f"custom loss {name!r}: the graph has {len(graph_json)} bytes, over the limit of "
                              f"{MAX_GRAPH_BYTES}")
    try:
        graph = json.loads(graph_json)
    except ValueError as e:
        raise InvalidArgument(f"custom loss {name!r}: the graph is not JSON: {e}") from None
    if not isinstance(graph, dict) or graph.get("format", 1) != 1 or not isinstance(graph.get("nodes"), list):
        raise InvalidArgument(f"custom loss {name!r}: the graph must be {{\"format\": 1, \"nodes\": [...]}}")
    declared = check_inputs(name, inputs)
    nodes = graph["nodes"]
    if len(nodes) > MAX_NODES:
        raise InvalidArgument(f"custom loss {name!r}: {len(nodes)} nodes, over the limit of {MAX_NODES}")
    return _Checker(name, declared).run(nodes)


class _Checker:
    """One pass over the nodes: names, ops, targets, arguments, depth, output."""

    def __init__(self, name: str, inputs: tuple[tuple[str, int], ...]) -> None:
        self.name, self.inputs = name, inputs
        self.depth: dict[str, int] = {}  # node -> longest chain of calls from an input
        self.params: list[str] = []  # placeholder nodes, in input order

    def run(self, nodes: list[Any]) -> LossGraph:
        calls: list[Node] = []
        output: tuple[str, dict[str, str]] | None = None
        for i, raw in enumerate(nodes):
            where = f"custom loss {self.name!r}: node {i}"
            if not isinstance(raw, dict):
                raise InvalidArgument(f"{where} is not an object")
            node_name, op, target = raw.get("name"), raw.get("op"), raw.get("target")
            if not isinstance(node_name, str) or not _NAME.fullmatch(node_name) or node_name in self.depth:
                raise InvalidArgument(f"{where}: name {str(node_name)[:80]!r} must be a new identifier")
            where = f"custom loss {self.name!r}: node {i} ({node_name})"
            if output is not None:
                raise InvalidArgument(f"{where} comes after the output node")
            if not isinstance(target, str):
                raise InvalidArgument(f"{where}: target must be a string")
            if op == "placeholder":
                self._placeholder(where, i, node_name, target)
            elif op in ("call_function", "call_method"):
                calls.append(self._call(where, node_name, op, target, raw))
            elif op == "output":
                output = self._output(where, raw)
            else:
                raise InvalidArgument(f"{where}: op {str(op)[:40]!r} is not allowed; a custom loss may use "
                                      "placeholder, call_function, call_method and output nodes only")
        if len(self.params) != len(self.inputs):
            raise InvalidArgument(f"custom loss {self.name!r}: the graph has {len(self.params)} placeholders for "
                                  f"{len(self.inputs)} declared inputs")
        if output is None:
            raise InvalidArgument(f"custom loss {self.name!r}: the graph has no output node")
        return LossGraph(self.name, self.inputs, tuple(self.params), tuple(calls), output[0], output[1])

    def _placeholder(self, where: str, i: int, node_name: str, target: str) -> None:
        if i >= len(self.inputs) or self.inputs[i][0] != target:
            expected = self.inputs[i][0] if i < len(self.inputs) else "a call (all inputs are placed)"
            raise InvalidArgument(f"{where}: placeholder {target[:80]!r} where the declared inputs put {expected!r}")
        self.depth[node_name] = 0
        self.params.append(node_name)

    def _call(self, where: str, node_name: str, op: str, target: str, raw: dict[str, Any]) -> Node:
        table = FUNCTIONS if op == "call_function" else METHODS
        if target not in table:
            kind = "function" if op == "call_function" else "tensor method"
            raise InvalidArgument(f"{where}: {kind} {target[:80]!r} is not one a custom loss may call (allowed: "
                                  f"{', '.join(sorted(table))})")
        args, kwargs = raw.get("args", []), raw.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise InvalidArgument(f"{where}: args must be a list and kwargs an object")
        unknown = sorted(set(kwargs) - table[target])
        if unknown:
            raise InvalidArgument(f"{where}: {target} takes no keyword argument(s) {unknown} here (accepted: "
                                  f"{sorted(table[target])})")
        refs: list[str] = []
        node = Node(node_name, op, target, tuple(self._arg(where, a, refs) for a in args),
                    {k: self._arg(where, v, refs) for k, v in kwargs.items()})
        if op == "call_method" and not (node.args and isinstance(node.args[0], Ref)):
            raise InvalidArgument(f"{where}: method {target} must be called on a node")
        self.depth[node_name] = 1 + max((self.depth[r] for r in refs), default=0)
        if self.depth[node_name] > MAX_DEPTH:
            raise InvalidArgument(f"{where}: the graph is deeper than {MAX_DEPTH} calls here")
        return node

    def _arg(self, where: str, value: Any, refs: list[str]) -> Any:
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, list):
            return [self._arg(where, v, refs) for v in value]
        if isinstance(value, dict) and len(value) == 1:
            ((kind, inner),) = value.items()
            if kind == "ref" and isinstance(inner, str):
                if inner not in self.depth:
                    raise InvalidArgument(f"{where}: argument refers to {inner[:80]!r}, which is no earlier node")
                refs.append(inner)
                return Ref(inner)
            if kind == "tuple" and isinstance(inner, list):
                return tuple(self._arg(where, v, refs) for v in inner)
            if kind == "slice" and isinstance(inner, list) and len(inner) == 3 and all(
                    v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in inner):
                return slice(*inner)
            if kind == "ellipsis" and inner is True:
                return Ellipsis
            if kind == "float" and inner in _SPECIAL_FLOATS:
                return _SPECIAL_FLOATS[inner]
        raise InvalidArgument(f"{where}: argument {json.dumps(value)[:80]} is not one a custom loss may pass "
                              "(nodes, numbers, booleans, None, lists, tuples, slices and Ellipsis)")

    def _output(self, where: str, raw: dict[str, Any]) -> tuple[str, dict[str, str]]:
        args = raw.get("args")
        shape_error = InvalidArgument(f"{where}: the output must be (loss, {{metric: node}}), each a node")
        if not (isinstance(args, list) and len(args) == 1):
            raise shape_error
        pair = args[0].get("tuple") if isinstance(args[0], dict) else args[0]  # returned as a tuple or a list
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], dict)
                and isinstance(pair[1].get("dict"), dict)):
            raise shape_error
        refs: list[str] = []
        loss = self._arg(where, pair[0], refs)
        metrics = {k: self._arg(where, v, refs) for k, v in pair[1]["dict"].items()}
        if not isinstance(loss, Ref) or not all(isinstance(v, Ref) for v in metrics.values()):
            raise shape_error
        bad = [k for k in metrics if not _METRIC_KEY.fullmatch(k)]
        if bad:
            raise InvalidArgument(f"{where}: metric {bad[0][:80]!r} must be named custom/<name>:sum or "
                                  "custom/<name>:mean")
        return loss.name, {k: v.name for k, v in metrics.items()}
