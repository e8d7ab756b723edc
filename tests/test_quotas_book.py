"""Per-tenant quotas on their own (issue 9, item 4): the quota book with a clock the test moves (the token window,
the pressure that holds new work back), quota files in JSON and TOML, and the bank paging out a tenant's own
adapters with a pinned cycle. The refusals through the doors: tests/test_quotas.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import lathe
from lathe.errors import ResourceExhausted
from lathe.gateway.quotas import QuotaConfig, Quotas, TenantQuotas
from lathe.v1 import lathe_pb2 as pb
from tests.quota_helpers import BASE, _datum


def test_token_window_admits_again_once_the_oldest_tokens_leave_it() -> None:
    now = [1000.0]
    q = Quotas(QuotaConfig(TenantQuotas(max_tokens_per_minute=60)), clock=lambda: now[0])
    fb = {"forward_backward": pb.ForwardBackwardRequest(data=[lathe.wire.datum_to_proto(_datum(30))])}
    q.admit_op("t", 0, fb)
    now[0] += 10
    q.charge("t", 20)  # sampled tokens, paid after the fact
    with pytest.raises(ResourceExhausted) as e:
        q.admit_op("t", 0, fb)
    assert e.value.retry_after_s == 50.0  # when the first 30 leave the window
    assert e.value.message == ("quota max_tokens_per_minute: tenant spent 50 tokens in the last 60 s and the request "
                               "has 30, the limit is 60; retry in 50.0 s")
    q.admit_op("u", 0, fb)  # another tenant has its own window
    now[0] = 1059.5
    with pytest.raises(ResourceExhausted, match="tenant spent 50 tokens"):  # nothing was charged by the refusals
        q.admit_op("t", 0, fb)
    now[0] = 1060.0
    q.admit_op("t", 0, fb)  # the first 30 have left: 20 + 30
    with pytest.raises(ResourceExhausted, match="tenant spent 50 tokens"):
        q.admit_op("t", 0, fb)
    q.admit_op("t", 0, {"optim_step": pb.OptimStepRequest()})  # spends no tokens: admitted however full


def test_quota_files_json_and_toml_override_per_tenant(tmp_path: Path) -> None:
    doc = {"default": {"max_runs": 5}, "tenants": {"alice": {"max_inflight_ops": 3}}}
    as_json = tmp_path / "q.json"
    as_json.write_text(json.dumps(doc))
    as_toml = tmp_path / "q.toml"
    as_toml.write_text("[default]\nmax_runs = 5\n[tenants.alice]\nmax_inflight_ops = 3\n")
    for path in (as_json, as_toml):
        cfg = QuotaConfig.from_file(path)
        assert cfg.of("alice") == TenantQuotas(max_runs=5, max_inflight_ops=3)
        assert cfg.of("bob") == TenantQuotas(max_runs=5)
    assert QuotaConfig.from_file(None) == QuotaConfig()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tenants": {"alice": {"max_run": 3}}}))
    with pytest.raises(ValueError, match=rf"quotas file {re.escape(str(bad))}: tenants.alice: unknown quota "
                                         r"'max_run'"):
        QuotaConfig.from_file(bad)
    bad.write_text(json.dumps({"default": {"max_checkpoint_bytes": 0}}))
    with pytest.raises(ValueError, match="default: quota max_checkpoint_bytes must be an integer >= 1, got 0"):
        QuotaConfig.from_file(bad)


def test_bank_pages_out_the_tenants_own_adapters_never_pinned_ones(tiny_dir: Path, tmp_path: Path) -> None:
    from lathe.models.config import ModelConfig
    from lathe.models.lora import LoraSpec
    from lathe.trainer.bank import Adapter, AdapterBank
    from lathe.trainer.pages import DirPages

    cfg = ModelConfig.from_dir(tiny_dir)
    bank = AdapterBank(8, DirPages(tmp_path), "float32", lambda _: cfg)
    bank.limit_tenant("a", 1)
    for mid, tenant in (("b1", "b"), ("a1", "a"), ("b2", "b"), ("a2", "a")):
        bank.add(Adapter.fresh(mid, tenant, BASE, cfg, LoraSpec(rank=2), seed=len(mid)))
    assert bank.evict(pinned={"a1", "a2"}) == 0  # a cycle holds both: they stay until it ends
    assert bank.evict(pinned=set()) == 1 and (bank.resident, bank.paged) == (3, 1)
    assert not _resident(bank, "a1") and all(_resident(bank, m) for m in ("a2", "b1", "b2"))
    bank.get("a1")  # paged back in, now the most recent: a2 goes next
    assert bank.evict(pinned=set()) == 1
    assert _resident(bank, "a1") and not _resident(bank, "a2")
    bank.limit_tenant("a", 0)  # no quota of its own: only the capacity binds
    bank.get("a2")
    assert bank.evict(pinned=set()) == 0 and bank.resident == 4


def _resident(bank: object, model_id: str) -> bool:
    return bank._slots[model_id].adapter is not None  # what the bank holds in memory


def test_pressure_names_the_quota_that_holds_new_work_back() -> None:
    now = [1000.0]
    q = Quotas(QuotaConfig(TenantQuotas(max_tokens_per_minute=60, max_inflight_ops=3)), clock=lambda: now[0])
    assert q.pressure("t", 2) is None
    assert q.pressure("t", 3) == "quota max_inflight_ops: 3 requests in flight, the limit is 3"
    q.charge("t", 59)
    assert q.pressure("t", 0) is None  # one token of room left
    q.charge("t", 1)
    assert q.pressure("t", 0) == "quota max_tokens_per_minute: 60 tokens in the last 60 s, the limit is 60"
    assert q.pressure("u", 0) is None  # another tenant's window is its own
    now[0] += 60
    assert q.pressure("t", 0) is None  # the tokens have left the window
