"""Hostile custom losses (issue 22, H1 and H2), fuzzed: a hypothesis corpus of graphs and of JSON nodes against
the checker, the shape rules and the evaluator; each is refused by name (InvalidArgument) or accepted, and an
accepted graph evaluates to the shapes inferred for it. The cases made by hand: tests/test_hostile_losses.py."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from lathe.errors import InvalidArgument, LatheError
from lathe.loss_graph import BOUND, DIM, FLAG, FUNCTIONS, INDEX, METHODS, NODE, NUMBER, OPERAND, check_graph
from lathe.trainer.custom_loss import CustomLoss
from tests.test_hostile_losses import call, graph, ref

_ALL = sorted(FUNCTIONS) + sorted(METHODS)
_NUMBERS = st.one_of(st.integers(-4, 4), st.floats(-3, 3), st.booleans())
_ONE_IN_25 = st.sampled_from([False] * 24 + [True])
_HOSTILE = st.sampled_from([2**31 - 1, -(2**31), 10**12, 1e300, {"float": "inf"}, {"float": "nan"}, "text", [0],
                            [[1, 2]], {"dtype": "float64"}, {"ref": 3}, {"slice": [0, 1]}, [None], {"ellipsis": False},
                            {"tuple": [{"ref": "nowhere"}]}])


def _index(refs: list[str]) -> st.SearchStrategy:
    one = st.one_of(st.integers(-3, 3), st.none(), st.just({"ellipsis": True}),
                    st.builds(lambda a, b, c: {"slice": [a, b, c]}, st.one_of(st.none(), st.integers(-3, 3)),
                              st.one_of(st.none(), st.integers(-3, 3)), st.one_of(st.none(), st.integers(-1, 2))),
                    st.lists(st.integers(-3, 3), max_size=3))
    return st.one_of(one, st.lists(one, max_size=4).map(lambda xs: {"tuple": xs}))


def _kinds(refs: list[str]) -> dict[str, st.SearchStrategy]:
    """A strategy for each kind of argument (``lathe.loss_graph``'s), over the nodes ``refs``."""
    node = st.sampled_from(refs).map(ref)
    dim = st.one_of(st.none(), st.integers(-2, 2), st.lists(st.integers(-2, 2), max_size=2),
                    st.lists(st.integers(-2, 2), max_size=2).map(lambda xs: {"tuple": xs}))
    return {NODE: node, OPERAND: st.one_of(node, node, _NUMBERS), BOUND: st.one_of(node, _NUMBERS, st.none()),
            NUMBER: _NUMBERS, DIM: dim, FLAG: st.booleans(), INDEX: _index(refs)}


@st.composite
def _graphs(draw: st.DrawFn, calls: int = 6, hostile: bool = True) -> str:
    """A graph of up to ``calls`` calls over logprobs [T], w [T, K] and s []: arguments of the kinds each
    target's signature takes (so that many graphs run), and with ``hostile`` one in 25 a hostile one (a huge
    int, a list, a string, a bad ref), which may make a call on plain numbers."""
    refs = ["logprobs", "w", "s"]
    nodes = []
    for i in range(draw(st.integers(1, calls))):
        target = draw(st.sampled_from(_ALL + ["operator.getitem"] * 6))  # indexing has the most rules
        sig = FUNCTIONS.get(target) or METHODS[target]
        kinds = _kinds(refs)

        def value(kind: str, kinds: dict[str, st.SearchStrategy] = kinds) -> Any:
            return draw(_HOSTILE if hostile and draw(_ONE_IN_25) else kinds[kind])

        given_n = draw(st.integers(sig.required, len(sig.params)))
        args = [value(kind) for _, kind in sig.params[:given_n]]
        names = [name for name, _ in sig.params[given_n:] if name in sig.keywords]
        kwargs = {name: value(dict(sig.params)[name]) for name in draw(st.lists(st.sampled_from(names), unique=True))
                  } if names else {}
        nodes.append(call(f"n{i}", target, *args, op="call_function" if target in FUNCTIONS else "call_method",
                          **kwargs))
        refs.append(f"n{i}")
    nodes.append(call("total", "sum", ref(refs[-1]), op="call_method"))
    return graph(*nodes, inputs=[("logprobs", 1), ("w", 2), ("s", 0)])


FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.one_of(_graphs(), _graphs(calls=1, hostile=False)), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 2**16))
def test_fuzzed_graphs_are_refused_by_name_or_evaluate_to_their_inferred_shapes(graph_json: str, t: int, k: int,
                                                                               seed: int) -> None:
    """Whatever the graph: the checker and the shape rules answer InvalidArgument or accept; an accepted graph
    evaluates to exactly the shapes inferred for it (never the Internal of a wrong rule), or fails at a node,
    named. Graphs of one well-formed call put each shape rule against torch's own."""
    inputs = [("logprobs", 1), ("w", 2), ("s", 0)]
    try:
        loss = CustomLoss(check_graph("fuzz", inputs, graph_json))
        gen = torch.Generator().manual_seed(seed)
        lp = -torch.rand(t, generator=gen).requires_grad_()
        values = {"w": torch.randn(t, k, generator=gen), "s": torch.randn((), generator=gen)}
        loss.plan([(t, values)])
        value, metrics = loss(lp, values)
    except InvalidArgument as e:
        assert e.message.startswith("custom loss 'fuzz'") or e.message.startswith("datum 0: custom loss 'fuzz'")
        return
    except LatheError as e:  # an Internal: the inferred shape was wrong
        pytest.fail(e.message)
    assert value.shape == () and value.dtype in (torch.float32, torch.bool, torch.int64)


_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
                     lambda inner: st.one_of(st.lists(inner, max_size=4),
                                             st.dictionaries(st.sampled_from(["ref", "tuple", "slice", "float",
                                                                              "ellipsis", "dict", "x"]), inner,
                                                             max_size=2)), max_leaves=12)


@FUZZ
@given(st.lists(st.fixed_dictionaries({"op": st.sampled_from(["call_function", "call_method", "output", "get_attr"]),
                                       "name": st.sampled_from(["a", "b", "logprobs", "1x"]),
                                       "target": st.sampled_from([*_ALL[:6], "os.system", "output"]),
                                       "args": _JSON, "kwargs": _JSON}), max_size=5))
def test_fuzzed_json_nodes_are_accepted_or_refused_with_invalid_argument(nodes: list[dict]) -> None:
    head = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}]
    try:
        check_graph("fuzz", [("logprobs", 1)], json.dumps({"format": 1, "nodes": head + nodes}))
    except InvalidArgument as e:
        assert e.message.startswith("custom loss 'fuzz'")
