"""Hostile custom losses (issue 22, H1 and H2): graphs that would compute on plain Python values or build huge
tensors are refused by name before anything runs, every exception of the evaluator fails its own operation
alone, a refused operation is never left pending in the ledger, and the tenants beside it in the same cycle
get the bits they get alone. The hypothesis corpus that fuzzes the checker, the shape rules and the evaluator:
tests/test_hostile_losses_fuzz.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lathe.errors import InvalidArgument
from lathe.gateway.store import ControlStore, StoreConfig
from lathe.loss_graph import MAX_INT, MAX_NODE_ELEMENTS, check_graph
from lathe.loss_shapes import infer_shapes
from lathe.loss_trace import LossHandle
from lathe.stack import Stack
from lathe.trainer import custom_loss
from lathe.trainer.custom_loss import MAX_LOSS_CALLS, MAX_LOSS_ELEMENTS, CustomLoss, LossBudget
from lathe.trainer.engine import TrainerEngine
from lathe.v1 import lathe_pb2 as pb
from tests.helpers import pb_datum, pb_tensor
from tests.test_hostile_doors import Grpc, Http
from tests.test_trainer_engine import _engine, _lp, batch, create, fb, opt, submit, weights

torch.set_num_threads(1)
INPUTS = [("logprobs", 1), ("w", 2)]


def call(name: str, target: str, *args: Any, op: str = "call_function", **kwargs: Any) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def graph(*calls: dict, inputs: list[tuple[str, int]] = INPUTS, loss: str | None = None) -> str:
    """The JSON of a graph over ``inputs`` whose loss is node ``loss`` (the last call's by default)."""
    head = [{"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n, _ in inputs]
    out = {"op": "output", "name": "output", "target": "output",
           "args": [{"tuple": [{"ref": loss or calls[-1]["name"]}, {"dict": {}}]}], "kwargs": {}}
    return json.dumps({"format": 1, "nodes": head + list(calls) + [out]})


def ref(name: str) -> dict:
    return {"ref": name}


SUM = call("s", "sum", ref("logprobs"), op="call_method")
POW = graph(call("p", "operator.pow", 3, 10**12), SUM, loss="s")
LIST_MUL = graph(call("m", "operator.mul", [0], 10**9), SUM, loss="s")
DIV = graph(call("d", "operator.truediv", 1, 0), SUM, loss="s")
# [T, 1, 1] * [1, T, 1] * [1, T, K] -> [T, T, K]
SQUARE = graph(call("a", "operator.getitem", ref("logprobs"), {"tuple": [{"slice": [None, None, None]}, None, None]}),
               call("b", "operator.getitem", ref("logprobs"), {"tuple": [None, {"slice": [None, None, None]}, None]}),
               call("c", "operator.getitem", ref("w"), {"tuple": [None, {"ellipsis": True}]}),
               call("ab", "operator.mul", ref("a"), ref("b")), call("abc", "operator.mul", ref("ab"), ref("c")),
               call("s", "sum", ref("abc"), op="call_method"))


# ---------- H1: refused at check time, by node and argument ----------


@pytest.mark.parametrize(("graph_json", "message"), [
    (POW, f"node 2 (p): argument 1 (other) of operator.pow is 1000000000000, outside the integers a custom loss "
          f"may pass (at most {MAX_INT} in magnitude)"),
    (LIST_MUL, "node 2 (m): argument 0 (input) of operator.mul is [0]; it must be a node or a number"),
    (DIV, "node 2 (d): operator.truediv needs a node among its positional arguments; on plain numbers ([1, 0])"),
    (graph(call("x", "operator.getitem", ref("logprobs"), ref("logprobs")), SUM, loss="s"),
     "node 2 (x): argument 1 (index) of operator.getitem holds {\"ref\": \"logprobs\"}; an index element must be"),
    (graph(call("x", "torch.sum", ref("logprobs"), dim=[0, 2**40]), SUM, loss="s"),
     "node 2 (x): keyword 'dim' of torch.sum is 1099511627776, outside the integers"),
    (graph(call("x", "torch.where", ref("logprobs")), SUM, loss="s"),
     "node 2 (x): torch.where takes 3 to 3 positional arguments, got 1"),
    (graph(call("x", "torch.clamp", ref("logprobs"), 0.0, min=1.0), SUM, loss="s"),
     "node 2 (x): torch.clamp is given ['min'] both by position and by keyword"),
    (json.dumps({"format": 1, "nodes": [[[[[]]]]]}).replace("[[[[]]]]", "[" * 5000 + "]" * 5000),
     "the graph is not JSON"),
])
def test_graphs_that_would_compute_on_python_values_are_refused_naming_node_and_argument(graph_json: str,
                                                                                         message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_graph("hostile", INPUTS, graph_json)
    assert e.value.message.startswith("custom loss 'hostile': ") and message in e.value.message, e.value.message


# ---------- H1: sized before anything is computed ----------


def test_a_chained_broadcast_to_t_squared_by_k_is_refused_before_it_is_built() -> None:
    loss = CustomLoss(check_graph("hostile", INPUTS, SQUARE))
    assert infer_shapes(loss.graph, [(7,), (7, 3)])["abc"] == (7, 7, 3)  # small: allowed
    with pytest.raises(InvalidArgument) as e:
        loss.plan([(2048, {"w": torch.empty(2048, 8, device="meta")})])
    assert e.value.message == (
        f"datum 0: custom loss 'hostile': node abc (operator.mul) would make a tensor of shape [2048, 2048, 8] "
        f"({2048 * 2048 * 8} elements, {4 * 2048 * 2048 * 8} bytes in fp32), over the limit of "
        f"{MAX_NODE_ELEMENTS} elements per node")
    with pytest.raises(InvalidArgument, match=r"node abc \(operator.mul\) cannot be computed for inputs of shapes "
                                              r"\[\[5\], \[4, 3\]\]: shapes \[\[5, 5, 1\], \[1, 4, 3\]\] do not "
                                              r"broadcast"):
        loss.plan([(5, {"w": torch.empty(4, 3)})])  # [T] with a [T', K] input: refused, not computed


def test_a_jobs_datums_are_held_to_the_element_and_call_budgets() -> None:
    square = graph(call("a", "operator.getitem", ref("logprobs"), {"tuple": [{"slice": [None, None, None]}, None]}),
                   call("aa", "operator.mul", ref("a"), ref("logprobs")), call("s", "sum", ref("aa"), op="call_method"),
                   inputs=[("logprobs", 1)])
    loss = CustomLoss(check_graph("square", [("logprobs", 1)], square))
    side = int(MAX_NODE_ELEMENTS ** 0.5)  # each datum's [T, T] fits a node, four of them do not fit a job
    loss.plan([(side, {})] * 3)
    with pytest.raises(InvalidArgument, match=r"^custom loss 'square': datums 0-3 make \d+ elements in its nodes, "
                                              rf"over the limit of {MAX_LOSS_ELEMENTS} per pass"):
        loss.plan([(side, {})] * 4)
    many = len(loss.graph.calls)
    with pytest.raises(InvalidArgument, match=rf"{MAX_LOSS_CALLS // many + 1} datums x {many} calls = "):
        loss.plan([(1, {})] * (MAX_LOSS_CALLS // many + 1))
    two = loss.elements([(side, {})] * 2)
    tight = CustomLoss(loss.graph, LossBudget(elements=two, calls=3 * many))  # a pool's own budgets
    tight.plan([(side, {})] * 2)
    with pytest.raises(InvalidArgument, match=rf"datums 0-2 make \d+ elements in its nodes, over the limit of {two} "
                                              "per pass"):
        tight.plan([(side, {})] * 3)
    with pytest.raises(InvalidArgument, match=rf"4 datums x {many} calls = {4 * many} node evaluations, over the "
                                              rf"limit of {3 * many} per pass"):
        tight.plan([(1, {})] * 4)


def test_the_trainer_takes_its_custom_loss_budgets_as_flags_and_refuses_bad_ones() -> None:
    bad = subprocess.run([sys.executable, "-m", "lathe.trainer", "--max-loss-calls", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "custom-loss budgets must be integers >= 1, got elements=67108864 and calls=0" \
        in bad.stderr, bad.stderr


# ---------- H2: every exception of the evaluator fails its own operation alone ----------


class _Raises(torch.autograd.Function):
    """The identity, whose backward raises the exception type in ``exc``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exc: type[BaseException]) -> torch.Tensor:
        ctx.exc = exc
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise ctx.exc("boom")


EXCEPTIONS = [ZeroDivisionError, OverflowError, AttributeError, MemoryError, RuntimeError, IndexError, KeyError,
              ValueError, TypeError, RecursionError, NotImplementedError]
EXPM1 = graph(call("e", "torch.expm1", ref("logprobs")), call("s", "sum", ref("e"), op="call_method"),
              inputs=[("logprobs", 1)])


def _custom_fb(model_id: str, seq: int, graph_json: str, data: list[pb.Datum]) -> pb.TrainerOp:
    for d in data:
        del d.loss_fn_inputs["weights"]  # the loss reads logprobs only
    op = fb(model_id, seq, data, "custom")
    op.forward_backward.custom_loss.CopyFrom(pb.CustomLoss(name="hostile", graph_json=graph_json, inputs=[
        pb.CustomLossInput(name="logprobs", rank=1)]))
    return op


@pytest.fixture(scope="module")
def engines(model_cache: Path, tiny_dir: Path) -> tuple[TrainerEngine, dict[str, Any]]:
    """A shared engine for the mixed cycles, and what the victim's loop gives alone: results and weights."""
    alone = _engine(model_cache)
    create(alone, "victim")
    futs = [submit(alone, op) for op in (fb("victim", 1, batch(2)), opt("victim", 2), fb("victim", 3, batch(4)))]
    while alone.run_cycle():
        pass
    return _engine(model_cache), {"results": [f.result() for f in futs], "weights": weights(alone, "victim")}


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: e.__name__)
def test_any_exception_of_a_custom_loss_fails_it_alone_and_its_cycle_mate_gets_its_solo_bits(
        engines: tuple[TrainerEngine, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
        exc: type[BaseException], where: str) -> None:
    eng, alone = engines
    case = f"{exc.__name__}-{where}"

    def hostile_expm1(x: torch.Tensor) -> torch.Tensor:
        if where == "forward":
            raise exc("boom")
        return _Raises.apply(x, exc)

    monkeypatch.setitem(custom_loss.FUNCTION_IMPLS, "torch.expm1", hostile_expm1)
    create(eng, f"hostile-{case}")
    create(eng, f"victim-{case}")  # the same seed as the solo victim: the same initial weights
    bad = submit(eng, _custom_fb(f"hostile-{case}", 1, EXPM1, batch(3, n=2)))
    futs = [submit(eng, op) for op in (fb(f"victim-{case}", 1, batch(2)), opt(f"victim-{case}", 2),
                                       fb(f"victim-{case}", 3, batch(4)))]
    while eng.run_cycle():
        pass
    got = bad.result()
    assert got.receipt.cycle == futs[0].result().receipt.cycle  # they shared the cycle
    assert got.WhichOneof("result") == "error"
    if where == "forward":
        assert (got.error.code, got.error.message) == (
            "InvalidArgument", f"custom loss 'hostile': node e (torch.expm1) failed: {exc.__name__}: 'boom'"
            if exc is KeyError else f"custom loss 'hostile': node e (torch.expm1) failed: {exc.__name__}: boom")
    else:
        assert got.error.code == "Internal" and got.error.message.startswith(
            f"custom loss 'hostile': the pass failed: {exc.__name__}: ")
    assert all(p.grad is None for p in eng.bank.get(f"hostile-{case}").weights.parameters())  # nothing applied
    for mine, solo in zip((f.result() for f in futs), alone["results"], strict=True):
        assert mine.WhichOneof("result") == solo.WhichOneof("result") != "error"
        if mine.WhichOneof("result") == "forward_backward":
            assert mine.forward_backward.metrics["loss:sum"] == solo.forward_backward.metrics["loss:sum"]
            assert all(np.array_equal(a, b) for a, b in zip(_lp(mine), _lp(solo), strict=True))
    got_w = weights(eng, f"victim-{case}")
    assert all(torch.equal(got_w[k], v) for k, v in alone["weights"].items())


def test_a_cycle_holds_custom_loss_elements_of_all_its_jobs_to_the_budget(
        engines: tuple[TrainerEngine, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs whose custom losses fit the budget one at a time but not together take two cycles; a
    built-in loss beside them is not held back."""
    eng, _ = engines
    outer = graph(call("a", "operator.getitem", ref("logprobs"), {"tuple": [{"slice": [None, None, None]}, None]}),
                  call("aa", "operator.mul", ref("a"), ref("logprobs")), call("s", "sum", ref("aa"), op="call_method"),
                  inputs=[("logprobs", 1)])

    def data() -> list[pb.Datum]:
        return [pb_datum(list(range(5, 17))) for _ in range(2)]  # 2 x (12 + 144 + 1) = 314 elements

    monkeypatch.setattr(eng, "cfg", replace(eng.cfg, loss_budget=LossBudget(elements=400)))  # --max-loss-elements
    for name in ("outer-a", "outer-b", "plain"):
        create(eng, name)
    futs = [submit(eng, _custom_fb("outer-a", 1, outer, data())), submit(eng, _custom_fb("outer-b", 1, outer, data())),
            submit(eng, fb("plain", 1, batch(5)))]
    while eng.run_cycle():
        pass
    a, b, plain = (f.result() for f in futs)
    assert [r.WhichOneof("result") for r in (a, b, plain)] == ["forward_backward"] * 3
    assert a.forward_backward.metrics == b.forward_backward.metrics  # the same loss on the same weights and data
    assert a.receipt.cycle != b.receipt.cycle and plain.receipt.cycle == min(a.receipt.cycle, b.receipt.cycle)


# ---------- through the real doors ----------


def _db(stack: Stack) -> ControlStore:
    args = stack.service("gateway").args
    return ControlStore(StoreConfig(url=args[args.index("--db") + 1]))


def test_hostile_graphs_are_refused_at_both_doors_and_never_left_pending(stack: Stack) -> None:
    http = Http(stack, "tml-mallory-http")
    session = http.ok("/create_session", {"user_metadata": {}})["session_id"]
    for graph_json, message in ((POW, "node 2 (p): argument 1 (other) of operator.pow is 1000000000000"),
                                (LIST_MUL, "node 2 (m): argument 0 (input) of operator.mul is [0]")):
        http.refused(http.post("/create_custom_loss", {
            "session_id": session, "custom_loss_seq_id": 0, "name": "hostile", "graph": json.loads(graph_json),
            "inputs": [{"name": n, "rank": r} for n, r in INPUTS]}), 400, "^custom loss 'hostile': .*" +
            message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"))
    door = Grpc(stack, "tml-mallory-grpc")
    model = door.model(seed=3)
    data = [pb_datum([5, 17, 42, 9], w=pb_tensor([[1.0]] * 4, "float32"))]
    del data[0].loss_fn_inputs["weights"]
    for seq, graph_json in ((1, POW), (2, LIST_MUL)):
        sub = door.call("ForwardBackward", pb.ForwardBackwardRequest(
            model_id=model, seq_id=seq, data=data, loss_fn="custom",
            custom_loss=LossHandle("hostile", tuple(INPUTS), graph_json).to_proto()))
        res = door.result(sub.request_id)
        assert res.error.code == "InvalidArgument" and "of operator." in res.error.message, res.error
    door.trains(model, 3)  # the run goes on from the next seq_id
    store = _db(stack)
    try:  # a restart would send nothing of these again: no operation of the run is pending
        assert [op for op in store.load().pending if op.key == model] == []
    finally:
        store.close()


def test_a_victim_beside_a_refused_loss_in_the_same_cycle_trains_as_alone(stack: Stack) -> None:
    """The hostile loss passes the checks but would build a [T, T, K] tensor: the trainer refuses it in the
    cycle, naming the node, and the victim's losses equal those of its loop alone, bit for bit. A third
    tenant's long forward pass holds the trainer while the two arrive, so that they share the next cycle."""
    victim, mallory, blocker = Grpc(stack, "tml-victim"), Grpc(stack, "tml-mallory"), Grpc(stack, "tml-blocker")
    t, k = 300, 200
    hostile_data = [pb_datum(list(range(3, 3 + t)), w=pb_tensor(np.ones((t, k)).tolist(), "float32"))]
    del hostile_data[0].loss_fn_inputs["weights"]  # the loss reads logprobs and w
    hostile_loss = LossHandle("square", tuple(INPUTS), SQUARE).to_proto()
    long = [pb_datum([(i * 7) % 250 + 3 for i in range(500)]) for _ in range(4)]
    data = [[pb_datum([5, 17, 42, 9, 33, 120, 7, 88])], [pb_datum([64, 3, 19, 5, 17, 42])], [pb_datum([9, 8, 7, 6, 5])]]

    def loop(model: str, beside: tuple[str, str] | None = None) -> tuple[list[float], list[bool]]:
        losses, shared = [], []
        for i, d in enumerate(data):
            if beside is not None:
                hostile, blocking = beside
                blocker.call("ForwardBackward", pb.ForwardBackwardRequest(
                    model_id=blocking, seq_id=i + 1, data=long, loss_fn="cross_entropy", forward_only=True))
                time.sleep(0.2)  # the long pass starts first (only whether the others share a cycle depends on it)
                bad = mallory.call("ForwardBackward", pb.ForwardBackwardRequest(
                    model_id=hostile, seq_id=i + 1, data=hostile_data, loss_fn="custom", custom_loss=hostile_loss))
            sub = victim.call("ForwardBackward", pb.ForwardBackwardRequest(
                model_id=model, seq_id=2 * i + 1, data=d, loss_fn="cross_entropy"))
            res = victim.result(sub.request_id)
            if beside is not None:
                refused = mallory.result(bad.request_id)
                shared.append(refused.receipt.cycle == res.receipt.cycle)
                assert refused.error.code == "InvalidArgument" and refused.error.message == (
                    f"datum 0: custom loss 'square': node abc (operator.mul) would make a tensor of shape "
                    f"[{t}, {t}, {k}] ({t * t * k} elements, {4 * t * t * k} bytes in fp32), over the limit of "
                    f"{MAX_NODE_ELEMENTS} elements per node")
            losses.append(res.forward_backward.metrics["loss:sum"])
            assert victim.step(model, 2 * i + 2).WhichOneof("result") == "optim_step"
        return losses, shared

    alone, _ = loop(victim.model(seed=11))
    beside, shared = loop(victim.model(seed=11), (mallory.model(seed=13), blocker.model(seed=12)))
    assert beside == alone
    assert any(shared), "the victim and the refused loss shared a cycle"
