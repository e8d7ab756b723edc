"""The shape of every node of a checked custom loss graph (``lathe.loss_graph.LossGraph``) for one datum, before
anything is computed: ``infer_shapes`` applies each call's shape rule (``Signature.shape``: same, broadcast, reduce,
reduce_dims, softmax, index) to the datum's input shapes and refuses, naming the node, a call whose arguments do not
fit, a tensor over ``MAX_NODE_ELEMENTS`` elements, a loss that is not a scalar and a metric that is not a single value.
Who uses it: the trainer (``lathe.trainer.custom_loss``), once per datum shape, before it evaluates a graph. Never
imports torch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from lathe.errors import InvalidArgument
from lathe.loss_graph import FUNCTIONS, MAX_NODE_ELEMENTS, METHODS, LossGraph, Ref

Shape = tuple[int, ...]


class _ShapeError(Exception):
    """A call whose arguments' shapes do not fit its rule (the message says how)."""


def infer_shapes(graph: LossGraph, inputs: Sequence[Shape]) -> dict[str, Shape]:
    """The shape of every node of ``graph`` for one datum whose inputs (logprobs first, in ``graph.inputs``
    order) have the shapes ``inputs``, by the rules of ``Signature.shape``, before anything is computed.

    Raises ``InvalidArgument`` naming the first node whose arguments do not fit (a broadcast, a dim or an
    index out of range), whose tensor would hold more than ``MAX_NODE_ELEMENTS`` elements, or, at the end, a
    loss that is not a scalar or a metric that is not a single value."""
    shapes = dict(zip(graph.params, inputs, strict=True))
    for node in graph.calls:
        sig = (FUNCTIONS if node.op == "call_function" else METHODS)[node.target]
        bound = {**{name: a for (name, _), a in zip(sig.params, node.args, strict=False)}, **node.kwargs}
        try:
            shape = _RULES[sig.shape](bound, shapes)
        except _ShapeError as e:
            raise InvalidArgument(f"custom loss {graph.name!r}: node {node.name} ({node.target}) cannot be computed "
                                  f"for inputs of shapes {[list(s) for s in inputs]}: {e}") from None
        if math.prod(shape) > MAX_NODE_ELEMENTS:
            raise InvalidArgument(f"custom loss {graph.name!r}: node {node.name} ({node.target}) would make a "
                                  f"tensor of shape {list(shape)} ({math.prod(shape)} elements, "
                                  f"{4 * math.prod(shape)} bytes in fp32), over the limit of {MAX_NODE_ELEMENTS} "
                                  "elements per node")
        shapes[node.name] = shape
    if shapes[graph.loss] != ():
        raise InvalidArgument(f"custom loss {graph.name!r} must return a scalar loss, got {shapes[graph.loss]} from "
                              f"node {graph.loss}")
    for key, name in graph.metrics.items():
        if math.prod(shapes[name]) != 1:
            raise InvalidArgument(f"custom loss {graph.name!r}: metric {key!r} (node {name}) is not a scalar: "
                                  f"shape {list(shapes[name])}")
    return shapes


def _shape(value: Any, shapes: dict[str, Shape]) -> Shape:
    return shapes[value.name] if isinstance(value, Ref) else ()


def _same(bound: dict[str, Any], shapes: dict[str, Shape]) -> Shape:
    return _shape(bound["input"], shapes)


def _broadcast(bound: dict[str, Any], shapes: dict[str, Shape]) -> Shape:
    operands = [_shape(v, shapes) for v in bound.values() if v is not None]
    out: list[int] = []
    for dims in itertools.zip_longest(*(reversed(s) for s in operands), fillvalue=1):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise _ShapeError(f"shapes {[list(s) for s in operands]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def _dim(d: int, ndim: int) -> int:
    """``d`` as a dimension of a tensor of ``ndim`` dimensions (a scalar has dimension 0 and -1, as in torch)."""
    n = max(ndim, 1)
    if not -n <= d < n:
        raise _ShapeError(f"dim {d} is out of range for {ndim} dimensions")
    return d % n


def _reduce(bound: dict[str, Any], shapes: dict[str, Shape]) -> Shape:
    x, dim, keep = _shape(bound["input"], shapes), bound.get("dim"), bound.get("keepdim", False)
    dims = [] if dim is None else [dim] if isinstance(dim, int) else list(dim)
    picked = [_dim(d, len(x)) for d in dims]
    if len(set(picked)) != len(picked):
        raise _ShapeError(f"dim {dims} names a dimension twice")
    if not x:
        return ()
    reduced = set(picked) if picked else set(range(len(x)))
    return tuple(1 if i in reduced else n for i, n in enumerate(x) if keep or i not in reduced)


def _reduce_dims(bound: dict[str, Any], shapes: dict[str, Shape]) -> Shape:
    if bound.get("dim") in (None, [], ()):
        raise _ShapeError("dim must name at least one dimension")
    return _reduce(bound, shapes)


def _softmax(bound: dict[str, Any], shapes: dict[str, Shape]) -> Shape:
    x, dim = _shape(bound["input"], shapes), bound.get("dim")
    if not isinstance(dim, int):
        raise _ShapeError(f"dim must be an int, got {dim!r}")
    _dim(dim, len(x))
    return x


def _index(bound: dict[str, Any], shapes: dict[str, Shape]) -> Shape:
    x, index = _shape(bound["input"], shapes), bound["index"]
    items = list(index) if isinstance(index, tuple) else [index]
    lists = sum(isinstance(i, list) for i in items)
    if lists > 1 or (lists and any(isinstance(i, int) for i in items)):
        raise _ShapeError("an index may hold one list of ints, beside slices, None and Ellipsis only")
    if items.count(Ellipsis) > 1:
        raise _ShapeError("an index may hold one Ellipsis")
    taken = sum(i is not None and i is not Ellipsis for i in items)
    if taken > len(x):
        raise _ShapeError(f"{taken} indices for a tensor of {len(x)} dimensions")
    if Ellipsis not in items:
        items.append(Ellipsis)
    at = items.index(Ellipsis)
    items[at:at + 1] = [slice(None)] * (len(x) - taken)
    out: list[int] = []
    dims = iter(x)
    for item in items:
        if item is None:
            out.append(1)
            continue
        size = next(dims)
        if isinstance(item, slice):
            if item.step is not None and item.step <= 0:
                raise _ShapeError(f"slice step {item.step} must be greater than zero")
            out.append(len(range(*item.indices(size))))
            continue
        bad = [i for i in (item if isinstance(item, list) else [item]) if not -size <= i < size]
        if bad:
            raise _ShapeError(f"index {bad[0]} is out of range for a dimension of size {size}")
        if isinstance(item, list):
            out.append(len(item))
    return tuple(out)


_RULES = {"same": _same, "broadcast": _broadcast, "reduce": _reduce, "reduce_dims": _reduce_dims,
          "softmax": _softmax, "index": _index}
