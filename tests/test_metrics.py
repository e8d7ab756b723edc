"""Every live service's /metrics moves with SDK calls, and the chart's dashboards and alerts query only metrics
that a live scrape has."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import lathe
from lathe.stack import Stack
from tests.helpers import next_token_datum, rl_datum

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = [REPO / "helm/lathe/dashboards/cycles.json", REPO / "helm/lathe/dashboards/service.json"]
RULES = REPO / "helm/lathe/alerts/rules.yaml"
BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]

# counters and histogram counts that must grow with the calls below, per service
MOVING = {
    "gateway": ["lathe_gateway_grpc_requests_total", "lathe_gateway_grpc_request_seconds_count",
                "lathe_gateway_http_requests_total", "lathe_gateway_http_request_seconds_count",
                "lathe_gateway_operations_total", "lathe_gateway_tenant_tokens_total"],
    "trainer": ["lathe_trainer_cycles_total", "lathe_trainer_cycle_seconds_count", "lathe_trainer_cycle_tokens_total",
                "lathe_trainer_tokens_per_cycle_count", "lathe_trainer_operation_wait_seconds_count",
                "lathe_trainer_sampler_kl_count", "lathe_trainer_grpc_requests_total"],
    "sampler": ["lathe_sampler_steps_total", "lathe_sampler_sampled_tokens_total", "lathe_sampler_prompt_tokens_total",
                "lathe_sampler_batch_sequences_count", "lathe_sampler_queue_wait_seconds_count",
                "lathe_sampler_request_seconds_count", "lathe_sampler_requests_total",
                "lathe_sampler_grpc_requests_total"],
    "checkpoints": ["lathe_checkpoints_saved_bytes_total", "lathe_checkpoints_save_seconds_count",
                    "lathe_checkpoints_loaded_bytes_total", "lathe_checkpoints_load_seconds_count",
                    "lathe_checkpoints_grpc_requests_total"],
}
# gauges that must be there (and positive) once the pools served
POSITIVE_GAUGES = {
    "trainer": ["lathe_trainer_cycle_capacity_tokens", "lathe_trainer_cycle_utilization",
                "lathe_trainer_adapters_in_cycle", "lathe_trainer_tenants_in_cycle", "lathe_trainer_resident_adapters",
                "lathe_trainer_exactness"],
    "sampler": ["lathe_sampler_kv_capacity_tokens", "lathe_sampler_exactness"],
}


def scrape(url: str) -> dict[str, float]:
    """Every sample name of a /metrics page, its values summed over label sets."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def live(shared_stack: Stack) -> Stack:
    """The shared stack (it serves metrics): other modules' tenants move its counters too, so they are read as
    differences."""
    return shared_stack


def test_every_service_exposes_its_metrics_and_they_move_with_sdk_calls(live: Stack) -> None:
    urls = live.metrics_urls
    assert sorted(urls) == ["checkpoints", "gateway", "sampler", "trainer"]
    before = {name: scrape(url) for name, url in urls.items()}
    with lathe.ServiceClient(base_url=live.gateway, api_key="tml-metrics") as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=3)
        tc.forward_backward([next_token_datum(PROMPT)], "cross_entropy").result()
        tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
        sampler = tc.save_weights_and_get_sampling_client("m1")
        res = sampler.sample(lathe.ModelInput.from_ints(PROMPT), 2,
                             lathe.SamplingParams(max_tokens=6, seed=7, stop=[])).result()
        # RL on the very policy that sampled: the sampler's logprobs are the trainer's, so the KL is exactly 0
        data = [rl_datum(PROMPT, s.tokens, s.logprobs, 1.0) for s in res.sequences]
        tc.forward_backward(data, "importance_sampling").result()
    req = urllib.request.Request(f"{live.http_url}/api/v1/healthz", headers={"X-API-Key": "tml-metrics"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    after = {name: scrape(url) for name, url in urls.items()}
    for service, names in MOVING.items():
        for name in names:
            assert after[service].get(name, 0.0) > before[service].get(name, 0.0), (service, name)
    for service, names in POSITIVE_GAUGES.items():
        for name in names:
            assert after[service].get(name, 0.0) > 0, (service, name)
    # exact pools: same bits, no divergence (other modules train off-policy on purpose, so the difference)
    assert after["trainer"]["lathe_trainer_sampler_kl_sum"] == before["trainer"]["lathe_trainer_sampler_kl_sum"]
    served = len(live.cfg.models.split(","))  # the gauge is 1 per model that passed its self-check, summed here
    assert after["trainer"]["lathe_trainer_exactness"] == after["sampler"]["lathe_sampler_exactness"] == served


def _exprs() -> list[str]:
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            exprs.extend(v for k, v in node.items() if k == "expr" and isinstance(v, str))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in DASHBOARDS:
        walk(json.loads(path.read_text()))
    walk(yaml.safe_load(RULES.read_text()))
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: label matchers, strings and durations removed; what is left
    that looks like a Lathe metric (every one starts with ``lathe_``)."""
    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r'"[^"]*"', "", bare)
    return set(re.findall(r"\blathe_[a-zA-Z0-9_:]*", bare))


def test_metric_names_are_read_from_promql() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(lathe_trainer_cycle_seconds_bucket{job=~"lathe_x"}[5m])))'
            ' / on() group_left sum(lathe_trainer_cycle_capacity_tokens)')
    assert metric_names(expr) == {"lathe_trainer_cycle_seconds_bucket", "lathe_trainer_cycle_capacity_tokens"}


def test_dashboards_and_alerts_query_only_metrics_a_live_scrape_has(live: Stack) -> None:
    present: set[str] = set()
    for url in live.metrics_urls.values():
        present |= set(scrape(url))
    exprs = _exprs()
    assert len(exprs) >= 15
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= present, (expr, sorted(names - present))


def test_dashboards_are_grafana_json_with_a_datasource_variable() -> None:
    titles = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        titles.add(board["title"])
        assert isinstance(board["schemaVersion"], int) and board["uid"]
        variables = board["templating"]["list"]
        assert any(v["type"] == "datasource" and v["name"] == "datasource" and v["query"] == "prometheus"
                   for v in variables)
        assert board["panels"]
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    assert titles == {"Lathe / cycles", "Lathe / service"}


def test_alert_rules_are_prometheus_rule_groups_with_the_four_alerts() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["alert"] for r in rules} == {"LatheCycleTimeHigh", "LatheQueueWaitHigh", "LathePoolNotExact",
                                           "LatheErrorRateHigh"}
    for r in rules:
        assert r["expr"] and r["for"] and r["labels"]["severity"] and r["annotations"]["summary"], r["alert"]
