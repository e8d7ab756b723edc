"""Custom loss graphs (tinker's ``create_custom_loss``) as checked data: the vocabulary, the limits, the shapes.

A client traces its per-datum loss ``fn(logprobs, *inputs) -> (loss, metrics)`` with ``torch.fx`` and sends the
nodes as JSON (tinker's ``CustomLossGraph``, format 1). ``check_graph`` turns that JSON into a ``LossGraph``
or refuses it with ``InvalidArgument`` naming the node and what is wrong with it. Who uses it: the Tinker HTTP
door when a loss is created (so a bad graph fails at ``create_custom_loss``, not at the first step) and the
trainer (``lathe.trainer.custom_loss``) before it evaluates a graph. This module never imports torch: it owns
the names a graph may call (``FUNCTIONS``, ``METHODS``: the ``Signature`` of each, what every argument may be
and the rule of its result's shape) and the trainer owns what each name computes; a test keeps the two tables
equal.

What a graph may be:

    nodes      at most MAX_NODES, names unique; placeholders first, one per declared input, in order
    ops        placeholder | call_function (a FUNCTIONS target) | call_method (a METHODS name) | output (last)
    arguments  as the target's Signature says, per parameter: an earlier node ({"ref": name}), a number (ints of
               at most MAX_INT in magnitude, floats, {"float": "inf" | "-inf" | "nan"}, booleans), None, a dim
               (ints), a flag, or getitem's index (ints, None, slices, Ellipsis, one list of ints); every call
               takes a node among its positional arguments, so nothing is ever computed on plain Python values
               (no ``3 ** 10**12``, no ``[0] * 10**9``); no strings, dtypes, devices or node indices
    depth      the longest chain of calls from an input to the output is at most MAX_DEPTH
    output     (loss, {metric: node}) with metric keys custom/<name>:sum or custom/<name>:mean
    inputs     logprobs first, with rank 1 ([T]: Lathe's trainer computes the target tokens' logprobs only);
               then at most MAX_INPUTS - 1 loss_fn_inputs keys of rank 0 (scalar), 1 ([T]) or 2 ([T, K])

What a graph computes for one datum is sized before it runs: ``lathe.loss_shapes.infer_shapes`` gives every
node's shape from the datum's input shapes, and refuses a node of more than MAX_NODE_ELEMENTS elements (e.g.
``[T, 1] * [1, T]`` chained into ``[T, T, K]``), a loss that is not a scalar and a metric that is not a single
value, naming the node. Every call is elementwise, a reduction, a softmax or an index: its work is linear in the
elements of its arguments and result, so bounding elements bounds time (the trainer's budgets:
``lathe.trainer.custom_loss``).
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
MAX_NODE_ELEMENTS = 2**24  # the most elements one node's tensor may hold (64 MiB in fp32)
MAX_INT = 2**31 - 1  # the largest integer argument, in magnitude (floats are bounded by their type)

# The kinds of argument a call may pass, by parameter
NODE = "node"  # an earlier node ({"ref": name}): a tensor
OPERAND = "operand"  # a node or a number
BOUND = "bound"  # a node, a number or None (clamp's min and max)
NUMBER = "number"  # a number
DIM = "dim"  # None, an int or a list / tuple of ints
FLAG = "flag"  # a boolean
INDEX = "index"  # getitem's index: an int, None, a slice, Ellipsis or a list of ints, or a tuple of these


@dataclass(frozen=True, slots=True)
class Signature:
    """What a call may pass and what shape it makes.

    ``params``: (name, kind) of each positional parameter, in order; the first ``required`` must be given and
    those in ``keywords`` may be given by name instead. ``shape`` names the rule of its result's shape
    (``infer_shapes``): "same" (the first argument's), "broadcast" (of every node and number it takes),
    "reduce" (over ``dim``, all dimensions when None or empty, kept as 1 with ``keepdim``), "reduce_dims" (the
    same, ``dim`` required), "softmax" (the input's, ``dim`` checked) or "index" (getitem's basic indexing, and
    one list of ints beside slices, None and Ellipsis)."""

    params: tuple[tuple[str, str], ...]
    required: int
    shape: str
    keywords: frozenset[str] = frozenset()


def _sig(shape: str, *params: tuple[str, str], required: int = 1, keywords: tuple[str, ...] = ()) -> Signature:
    return Signature(params, required, shape, frozenset(keywords))


_UNARY = _sig("same", ("input", NODE))
_BINARY = _sig("broadcast", ("input", OPERAND), ("other", OPERAND), required=2)
_REDUCE = _sig("reduce", ("input", NODE), ("dim", DIM), ("keepdim", FLAG), keywords=("dim", "keepdim"))
_LOGSUMEXP = _sig("reduce_dims", ("input", NODE), ("dim", DIM), ("keepdim", FLAG), keywords=("dim", "keepdim"))
_SOFTMAX = _sig("softmax", ("input", NODE), ("dim", DIM), keywords=("dim",))
_CLAMP = _sig("broadcast", ("input", NODE), ("min", BOUND), ("max", BOUND), keywords=("min", "max"))
# call_function targets (as tinker's SDK names them on the wire) -> what each may be passed
FUNCTIONS: dict[str, Signature] = {
    **{f"operator.{op}": _BINARY for op in ("add", "sub", "mul", "truediv", "pow", "gt", "ge", "lt", "le", "eq",
                                            "ne")},
    "operator.neg": _UNARY,
    "operator.abs": _UNARY,
    "operator.getitem": _sig("index", ("input", NODE), ("index", INDEX), required=2),
    **{f"torch.{fn}": _UNARY for fn in (
        "exp", "log", "log1p", "expm1", "abs", "sqrt", "square", "sigmoid", "tanh", "neg", "relu")},
    "torch.minimum": _sig("broadcast", ("input", NODE), ("other", NODE), required=2),
    "torch.maximum": _sig("broadcast", ("input", NODE), ("other", NODE), required=2),
    "torch.where": _sig("broadcast", ("condition", NODE), ("input", OPERAND), ("other", OPERAND), required=3),
    "torch.clamp": _CLAMP,
    "torch.sum": _REDUCE,
    "torch.mean": _REDUCE,
    "torch.logsumexp": _LOGSUMEXP,
    "torch.softmax": _SOFTMAX,
    "torch.log_softmax": _SOFTMAX,
    "torch._C._nn.log_sigmoid": _UNARY,  # torch.nn.functional.logsigmoid
    "torch._C._nn.softplus": _sig("same", ("input", NODE), ("beta", NUMBER), ("threshold", NUMBER),
                                  keywords=("beta", "threshold")),  # torch.nn.functional.softplus
}
# call_method names (torch.Tensor methods; the tensor is args[0]) -> what each may be passed
METHODS: dict[str, Signature] = {
    **{m: _UNARY for m in (
        "exp", "log", "log1p", "expm1", "abs", "sqrt", "square", "sigmoid", "tanh", "neg", "relu", "detach",
        "float")},
    "pow": _sig("broadcast", ("input", NODE), ("exponent", OPERAND), required=2),
    "clamp": _CLAMP,
    "clip": _CLAMP,
    "sum": _REDUCE,
    "mean": _REDUCE,
    "logsumexp": _LOGSUMEXP,
    "softmax": _SOFTMAX,
    "log_softmax": _SOFTMAX,
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _is_number(value: Any) -> bool:
    """A JSON number or boolean, or a special float ({"float": "inf" | "-inf" | "nan"})."""
    return isinstance(value, bool | int | float) or (
        isinstance(value, dict) and len(value) == 1 and isinstance(value.get("float"), str)
        and value["float"] in _SPECIAL_FLOATS)


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
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested too deep to read
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
        sig = table[target]
        args, kwargs = raw.get("args", []), raw.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise InvalidArgument(f"{where}: args must be a list and kwargs an object")
        unknown = sorted(set(kwargs) - sig.keywords)
        if unknown:
            raise InvalidArgument(f"{where}: {target} takes no keyword argument(s) {unknown} here (accepted: "
                                  f"{sorted(sig.keywords)})")
        if not sig.required <= len(args) <= len(sig.params):
            raise InvalidArgument(f"{where}: {target} takes {sig.required} to {len(sig.params)} positional "
                                  f"arguments, got {len(args)}")
        twice = sorted(k for k in kwargs if any(name == k for name, _ in sig.params[:len(args)]))
        if twice:
            raise InvalidArgument(f"{where}: {target} is given {twice} both by position and by keyword")
        refs: list[str] = []
        kinds = dict(sig.params)
        node = Node(node_name, op, target,
                    tuple(self._arg(f"{where}: argument {i} ({name}) of {target}", kind, a, refs)
                          for i, ((name, kind), a) in enumerate(zip(sig.params[:len(args)], args, strict=True))),
                    {k: self._arg(f"{where}: keyword {k!r} of {target}", kinds[k], v, refs)
                     for k, v in kwargs.items()})
        if not any(isinstance(a, Ref) for a in node.args):
            raise InvalidArgument(f"{where}: {target} needs a node among its positional arguments; on plain "
                                  f"numbers ({json.dumps(args)[:80]}) it would compute outside torch, unbounded")
        self.depth[node_name] = 1 + max((self.depth[r] for r in refs), default=0)
        if self.depth[node_name] > MAX_DEPTH:
            raise InvalidArgument(f"{where}: the graph is deeper than {MAX_DEPTH} calls here")
        return node

    def _arg(self, where: str, kind: str, value: Any, refs: list[str]) -> Any:
        """``value`` decoded as an argument of ``kind``; ``where`` names the node and the argument."""
        if kind in (NODE, OPERAND, BOUND) and isinstance(value, dict) and "ref" in value:
            return self._ref(where, value, refs)
        if kind in (OPERAND, BOUND, NUMBER) and _is_number(value):
            return self._number(where, value)
        if kind in (BOUND, DIM, INDEX) and value is None:
            return None
        if kind == FLAG and isinstance(value, bool):
            return value
        is_tuple = isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list)
        if kind == DIM and isinstance(value, int) and not isinstance(value, bool):
            return self._int(where, value)
        if kind == DIM and (isinstance(value, list) or is_tuple):
            ints = [self._int(where, v) for v in (value if isinstance(value, list) else value["tuple"])]
            return ints if isinstance(value, list) else tuple(ints)
        if kind == INDEX:
            return tuple(self._index(where, v) for v in value["tuple"]) if is_tuple else self._index(where, value)
        expected = {NODE: "a node", OPERAND: "a node or a number", BOUND: "a node, a number or None",
                    NUMBER: "a number", DIM: "None, an int or a list of ints", FLAG: "true or false",
                    INDEX: "an int, None, a slice, Ellipsis, a list of ints or a tuple of these"}[kind]
        raise InvalidArgument(f"{where} is {json.dumps(value)[:80]}; it must be {expected}")

    def _ref(self, where: str, value: dict[str, Any], refs: list[str]) -> Ref:
        inner = value["ref"]
        if len(value) != 1 or not isinstance(inner, str) or inner not in self.depth:
            raise InvalidArgument(f"{where} refers to {str(inner)[:80]!r}, which is no earlier node")
        refs.append(inner)
        return Ref(inner)

    @staticmethod
    def _number(where: str, value: Any) -> bool | int | float:
        if isinstance(value, dict):
            return _SPECIAL_FLOATS[value["float"]]
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise InvalidArgument(f"{where} is {str(value)[:40]}, outside the integers a custom loss may pass "
                                  f"(at most {MAX_INT} in magnitude); pass a float for a larger number")
        return value

    def _int(self, where: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{where} holds {json.dumps(value)[:80]}; it must be an int")
        return self._number(where, value)

    def _index(self, where: str, value: Any) -> Any:
        """One element of getitem's index: an int, None, a slice, Ellipsis or a list of ints (never a node:
        the shape of ``x[mask]`` depends on the data)."""
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return self._int(where, value)
        if isinstance(value, list):
            return [self._int(where, v) for v in value]
        if isinstance(value, dict) and len(value) == 1:
            ((kind, inner),) = value.items()
            if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
                return slice(*(None if v is None else self._int(where, v) for v in inner))
            if kind == "ellipsis" and inner is True:
                return Ellipsis
        raise InvalidArgument(f"{where} holds {json.dumps(value)[:80]}; an index element must be an int, None, a "
                              "slice, Ellipsis or a list of ints (not a node: use torch.where for a mask)")

    def _output(self, where: str, raw: dict[str, Any]) -> tuple[str, dict[str, str]]:
        args = raw.get("args")
        shape_error = InvalidArgument(f"{where}: the output must be (loss, {{metric: node}}), each a node")
        if not (isinstance(args, list) and len(args) == 1):
            raise shape_error
        pair = args[0].get("tuple") if isinstance(args[0], dict) else args[0]  # returned as a tuple or a list
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], dict)
                and isinstance(pair[1].get("dict"), dict)):
            raise shape_error
        values = [pair[0], *pair[1]["dict"].values()]
        if not all(isinstance(v, dict) and "ref" in v for v in values):
            raise shape_error
        refs: list[str] = []
        loss = self._ref(where, pair[0], refs)
        metrics = {k: self._ref(f"{where}: metric {k[:80]!r}", v, refs) for k, v in pair[1]["dict"].items()}
        bad = [k for k in metrics if not _METRIC_KEY.fullmatch(k)]
        if bad:
            raise InvalidArgument(f"{where}: metric {bad[0][:80]!r} must be named custom/<name>:sum or "
                                  "custom/<name>:mean")
        return loss.name, {k: v.name for k, v in metrics.items()}
