"""Server-side custom losses (tinker's ``create_custom_loss``): the graph checks, the trainer's fp32 evaluation
against a float64 reference, Lathe's encoder against tinker's, and one loss through both SDKs, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

import lathe
from lathe.errors import InvalidArgument, NotFound
from lathe.gateway.custom_losses import CustomLosses
from lathe.gateway.store import ControlStore, StoreConfig
from lathe.loss_graph import FUNCTIONS, MAX_DEPTH, MAX_NODES, METHODS, check_graph
from lathe.loss_trace import trace
from lathe.stack import Stack
from lathe.trainer.custom_loss import FUNCTION_IMPLS, CustomLoss
from lathe.v1 import lathe_pb2 as pb

BASE = "lathe/tiny-llama"


def dpo_like(logprobs, ref, sign):  # noqa: ANN001, ANN201 - traced by torch.fx
    margin = (logprobs - ref).sum() * sign
    loss = -F.logsigmoid(0.5 * margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/p:sum": torch.exp(logprobs).mean(dim=0)}


def clipped(logprobs, q, adv, w):  # noqa: ANN001, ANN201 - traced by torch.fx
    r = torch.exp(logprobs - q)
    c = torch.clamp(r, 0.8, max=1.2)
    pick = torch.where(adv > 0, torch.minimum(r * adv, c * adv), torch.maximum(r * adv, c * adv))
    extra = (w[..., 0] * logprobs).sum() + torch.logsumexp(logprobs, dim=0) + F.softplus(logprobs[1:]).mean()
    return -pick.sum() + extra ** 2 / 2, {"custom/ratio:mean": r.mean()}


RANKS = {dpo_like: {"logprobs": 1, "ref": 1, "sign": 0}, clipped: {"logprobs": 1, "q": 1, "adv": 1, "w": 2}}


def _ref_dpo(lp: np.ndarray, inp: dict[str, np.ndarray]) -> tuple[float, np.ndarray, dict[str, float]]:
    """(loss, dloss/dlp, metrics) by hand in float64."""
    m = (lp - inp["ref"]).sum() * inp["sign"]
    s = 1 / (1 + np.exp(-0.5 * m))
    return float(-np.log(s)), np.full_like(lp, -(1 - s) * 0.5 * inp["sign"]), \
        {"custom/margin:mean": float(m), "custom/p:sum": float(np.exp(lp).mean())}


def _ref_clipped(lp: np.ndarray, inp: dict[str, np.ndarray]) -> tuple[float, np.ndarray, dict[str, float]]:
    q, a, w = inp["q"], inp["adv"], inp["w"][:, 0]
    r = np.exp(lp - q)
    c = np.clip(r, 0.8, 1.2)
    use_r = np.where(a > 0, r * a <= c * a, r * a >= c * a)
    inside = (r > 0.8) & (r < 1.2)
    pick = np.where(use_r, r * a, c * a)
    d_pick = np.where(use_r | inside, r * a, 0.0)
    soft = np.log1p(np.exp(lp[1:]))
    extra = (w * lp).sum() + np.log(np.exp(lp).sum()) + soft.mean()
    d_extra = w + np.exp(lp) / np.exp(lp).sum()
    d_extra[1:] += 1 / (1 + np.exp(-lp[1:])) / (len(lp) - 1)
    return float(-pick.sum() + extra ** 2 / 2), -d_pick + extra * d_extra, {"custom/ratio:mean": float(r.mean())}


def _graph(fn) -> tuple[list[tuple[str, int]], str]:  # noqa: ANN001
    handle = trace(fn, RANKS[fn])
    return list(handle.inputs), handle.graph_json


@pytest.mark.parametrize(("fn", "ref"), [(dpo_like, _ref_dpo), (clipped, _ref_clipped)])
def test_the_trainer_evaluates_a_graph_in_fp32_as_float64_says(fn, ref) -> None:  # noqa: ANN001
    rng = np.random.default_rng(3)
    n = 9
    lp = -rng.exponential(1.0, n)
    inp = {"ref": lp + rng.normal(0, 0.3, n), "sign": np.array(-1.0), "q": lp + rng.normal(0, 0.3, n),
           "adv": rng.normal(0, 1, n), "w": rng.normal(0, 1, (n, 3))}
    inputs, graph_json = _graph(fn)
    loss = CustomLoss(check_graph(fn.__name__, inputs, graph_json))
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    value, metrics = loss(lp_t, {k: torch.tensor(v, dtype=torch.float32) for k, v in inp.items()})
    value.backward()
    want, want_grad, want_metrics = ref(lp, inp)
    assert value.dtype == torch.float32 and lp_t.grad.dtype == torch.float32
    np.testing.assert_allclose(float(value.detach()), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp_t.grad.numpy(), want_grad, rtol=1e-4, atol=1e-5)
    assert metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6)


def test_lathes_encoder_writes_tinkers_graph_node_for_node() -> None:
    for fn, ranks in RANKS.items():
        theirs = json.loads(encode_graph(trace_loss(fn, ranks, "s")).model_dump_json())
        assert json.loads(trace(fn, ranks).graph_json) == theirs


def test_every_name_a_graph_may_call_has_an_implementation() -> None:
    assert set(FUNCTION_IMPLS) == set(FUNCTIONS)
    assert all(callable(getattr(torch.Tensor, m)) for m in METHODS)


def _nodes(*calls: dict) -> str:
    head = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}]
    last = calls[-1]["name"] if calls else "logprobs"
    out = {"op": "output", "name": "output", "target": "output",
           "args": [{"tuple": [{"ref": last}, {"dict": {}}]}], "kwargs": {}}
    return json.dumps({"format": 1, "nodes": head + list(calls) + [out]})


def _call(name: str, target: str, *args: object, op: str = "call_function", **kwargs: object) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


@pytest.mark.parametrize(("graph", "message"), [
    (_nodes(_call("x", "os.system", "rm")), "node 1 (x): function 'os.system' is not one a custom loss may call"),
    (_nodes(_call("x", "backward", {"ref": "logprobs"}, op="call_method")),
     "node 1 (x): tensor method 'backward' is not one"),
    (_nodes({"op": "get_attr", "name": "w", "target": "weight", "args": [], "kwargs": {}}),
     "node 1 (w): op 'get_attr' is not allowed"),
    (_nodes(_call("x", "torch.exp", {"ref": "later"})),
     "node 1 (x): argument 0 (input) of torch.exp refers to 'later', which is no earlier node"),
    (_nodes(_call("x", "torch.sum", {"ref": "logprobs"}, dtype={"dtype": "float64"})),
     "node 1 (x): torch.sum takes no keyword argument(s) ['dtype']"),
    (_nodes(_call("x", "operator.add", {"ref": "logprobs"}, "text")),
     "node 1 (x): argument 1 (other) of operator.add is \"text\"; it must be a node or a number"),
    (_nodes(*[_call(f"n{i}", "torch.exp", {"ref": f"n{i - 1}" if i else "logprobs"}) for i in range(MAX_DEPTH + 1)]),
     f"node {MAX_DEPTH + 1} (n{MAX_DEPTH}): the graph is deeper than {MAX_DEPTH} calls"),
    (_nodes(*[_call(f"n{i}", "torch.exp", {"ref": "logprobs"}) for i in range(MAX_NODES)]),
     f"{MAX_NODES + 2} nodes, over the limit of {MAX_NODES}"),
])
def test_a_graph_outside_the_rules_is_refused_naming_its_node(graph: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match="^custom loss 'f': .*") as e:
        check_graph("f", [("logprobs", 1)], graph)
    assert message in e.value.message


def test_bad_inputs_and_outputs_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="logprobs has rank 2; Lathe serves rank 1"):
        check_graph("f", [("logprobs", 2)], _nodes())
    with pytest.raises(InvalidArgument, match="the graph has 1 placeholders for 2 declared inputs"):
        check_graph("f", [("logprobs", 1), ("adv", 1)], _nodes())
    bad_metric = json.loads(_nodes())
    bad_metric["nodes"][-1]["args"] = [{"tuple": [{"ref": "logprobs"}, {"dict": {"loss": {"ref": "logprobs"}}}]}]
    with pytest.raises(InvalidArgument, match="metric 'loss' must be named custom/<name>:sum"):
        check_graph("f", [("logprobs", 1)], json.dumps(bad_metric))


def test_a_loss_that_is_not_a_scalar_fails_naming_its_node() -> None:
    loss = CustomLoss(check_graph("f", [("logprobs", 1)], _nodes(_call("e", "torch.exp", {"ref": "logprobs"}))))
    with pytest.raises(InvalidArgument, match=r"custom loss 'f' must return a scalar loss, got \(4,\) from node e"):
        loss(torch.zeros(4), {})


def _data(sdk) -> list:  # noqa: ANN001 - tinker or lathe
    rng = np.random.default_rng(5)
    out = []
    for sign in (1.0, -1.0, 1.0):
        toks = rng.integers(3, 500, 12).tolist()
        out.append(sdk.Datum(model_input=sdk.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
            "target_tokens": toks[1:],
            "ref": sdk.TensorData(data=(-rng.uniform(3, 8, 11)).tolist(), dtype="float32", shape=[11]),
            "sign": sdk.TensorData(data=[sign], dtype="float32", shape=[])}))
    return out


def test_one_graph_trains_bit_for_bit_alike_through_both_sdks(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-custom")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-custom")
    theirs = sc.create_custom_loss(dpo_like, RANKS[dpo_like]).result()
    ours = lc.create_custom_loss(dpo_like, RANKS[dpo_like]).result()
    assert theirs.loss_id is not None  # uploaded: the server runs it
    t = sc.create_lora_training_client(BASE, rank=4, seed=8).result()
    lt = lc.create_lora_training_client(BASE, rank=4, seed=8)
    for _ in range(2):
        a = t.forward_backward_custom(_data(tinker), theirs).result()
        b = lt.forward_backward_custom(_data(lathe), ours).result()
        t.optim_step(tinker.AdamParams(learning_rate=0.05)).result()
        lt.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
        assert a.metrics == b.metrics and set(a.metrics) == {"loss:sum", "custom/margin:mean", "custom/p:sum"}
        assert [o["logprobs"].tolist() for o in a.loss_fn_outputs] == \
            [o["logprobs"].tolist() for o in b.loss_fn_outputs]
    # the margin moved: the step trained on the custom loss
    assert a.metrics["custom/margin:mean"] != t.forward_backward_custom(_data(tinker), theirs).result().metrics[
        "custom/margin:mean"]
    with pytest.raises(tinker.RequestFailedError, match=r"datum 0: loss_fn_inputs\['sign'\] has 2 values; the loss "
                       "declared it rank 0"):
        bad = _data(tinker)
        bad[0] = tinker.Datum(model_input=bad[0].model_input, loss_fn_inputs={
            **bad[0].loss_fn_inputs, "sign": tinker.TensorData(data=[1.0, 2.0], dtype="float32", shape=[2])})
        t.forward_backward(bad, "custom", {"loss_id": theirs.loss_id}).result()
    sc.close("success").result()
    lc.close()


def test_losses_are_kept_per_tenant_in_the_database_for_every_replica(tmp_path: Path) -> None:
    """Two gateways over one database resolve each other's losses; a tenant past its ``max_custom_losses``
    loses its own oldest, never another tenant's; no tenant resolves another's id."""
    url = f"sqlite:///{tmp_path}/control.db"
    one, two = ControlStore(StoreConfig(url=url)), ControlStore(StoreConfig(url=url))
    try:
        here, there = CustomLosses(one, lambda tenant: 3), CustomLosses(two, lambda tenant: 3)
        loss = trace(dpo_like, RANKS[dpo_like]).to_proto()
        victim = here.create("victim", "s-victim", 0, loss)
        flood = [here.create("mallory", "s-mallory", i, loss) for i in range(10)]

        def resolve(registry: CustomLosses, tenant: str, loss_id: str) -> pb.CustomLoss:
            req = pb.ForwardBackwardRequest(custom_loss=pb.CustomLoss(loss_id=loss_id))
            registry.resolve(tenant, req)
            return req.custom_loss

        got = resolve(there, "victim", victim)
        assert (got.loss_id, got.graph_json, list(got.inputs)) == (victim, loss.graph_json, list(loss.inputs))
        assert [resolve(there, "mallory", i).loss_id for i in flood[-3:]] == flood[-3:]
        for gone in flood[:-3]:
            with pytest.raises(NotFound, match=f"{gone!r} names no custom loss of this account"):
                resolve(there, "mallory", gone)
        with pytest.raises(NotFound, match="names no custom loss of this account"):
            resolve(here, "mallory", victim)
    finally:
        one.close()
        two.close()


def test_a_created_loss_trains_after_a_gateway_restart(stack: Stack) -> None:
    """The official SDK's handle names a loss the restarted gateway still has (it used to live in its memory)."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-custom-restart")
    handle = sc.create_custom_loss(dpo_like, RANKS[dpo_like]).result()
    t = sc.create_lora_training_client(BASE, rank=4, seed=9).result()
    before = t.forward_backward_custom(_data(tinker), handle).result()
    stack.kill("gateway")
    stack.restart("gateway")
    after = t.forward_backward_custom(_data(tinker), handle).result()
    assert after.metrics == before.metrics  # no step between them: the same loss of the same weights
    other = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-custom-other")
    theirs = other.create_lora_training_client(BASE, rank=4, seed=9).result()
    with pytest.raises(tinker.NotFoundError, match="names no custom loss of this account"):
        theirs.forward_backward(_data(tinker), "custom", {"loss_id": handle.loss_id}).result()
