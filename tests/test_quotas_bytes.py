"""Quotas in bytes where bytes run out (issue 22: H5, H6, M5, M9), on the gateway's own parts in-process: the adapter
bytes of the built-in models against the catalog's shapes, a sample's tokens charged at admission and given back,
finished results kept by bytes and an expired one answered as expired, session search reading a bounded number of
sessions per page, and a finished session let go of in memory. The refusals through the doors are in
tests/test_quotas.py."""

from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path

import pytest

from lathe.errors import NotFound, ResourceExhausted, SessionGone
from lathe.gateway.core import GatewayCore
from lathe.gateway.futures import FutureStore
from lathe.gateway.quotas import QuotaConfig, Quotas, TenantQuotas, adapter_bytes
from lathe.gateway.records import Operation, SamplingSession, Session
from lathe.gateway.session_search import MAX_SCANNED, SessionQuery, search
from lathe.gateway.store import ControlStore, StoreConfig
from lathe.v1 import lathe_pb2 as pb

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_adapter_bytes_follow_the_lora_cost_the_trainer_reports(model_cache: Path) -> None:
    """The trainer reports each model's LoRA cost per rank from the model's own config (so a model directory only
    the pools can read is counted too); the quota's bytes are what a fresh adapter and its AdamW moments hold."""
    from lathe.models.catalog import BUILTIN, ModelCatalog
    from lathe.models.config import ModelConfig
    from lathe.models.lora import LoraSpec, LoraWeights
    from lathe.trainer.lifecycle import lora_cost

    for name in BUILTIN:
        path = ModelCatalog.default(model_cache, [name]).resolve(name).path
        cfg = ModelConfig.from_dir(path)
        for attn, mlp, unembed in itertools.product((False, True), repeat=3):
            if not (attn or mlp or unembed):
                continue
            spec = LoraSpec(rank=3, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
            lora = pb.LoraConfig(rank=3, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
            held = sum(t.numel() * t.element_size() for t in LoraWeights.init(cfg, spec, 0).named_parameters().values())
            assert adapter_bytes(lora_cost(path), lora, "adamw") == 3 * held, (name, attn, mlp, unembed)
            assert adapter_bytes(lora_cost(path), lora, "dimuon") == 2 * held
    smollm2 = lora_cost(ModelCatalog.default(model_cache, [SMOLLM2]).resolve(SMOLLM2).path)
    every = pb.LoraConfig(rank=256, train_attn=True, train_mlp=True, train_unembed=True)
    assert adapter_bytes(smollm2, every, "adamw") == 1_090_584_576  # the issue's ~1.09 GB per rank-256 run
    assert adapter_bytes(None, every, "adamw") == 0  # a model no pool present reports


def _sample(prompt: int, num_samples: int, max_tokens: int | None) -> pb.SampleRequest:
    params = pb.SamplingParams() if max_tokens is None else pb.SamplingParams(max_tokens=max_tokens)
    return pb.SampleRequest(prompt=range(prompt), num_samples=num_samples, params=params)


def test_a_sample_is_charged_what_it_may_sample_at_admission_and_gets_back_what_it_did_not() -> None:
    now = [1000.0]
    q = Quotas(QuotaConfig(TenantQuotas(max_tokens_per_minute=100)), clock=lambda: now[0])
    first = q.admit_sample("t", 0, _sample(5, 4, 10), context_length=64)  # 5 + 4 x 10
    second = q.admit_sample("t", 0, _sample(5, 4, 10), context_length=64)
    with pytest.raises(ResourceExhausted) as e:
        q.admit_sample("t", 0, _sample(5, 1, 30), context_length=64)
    assert e.value.message.startswith("quota max_tokens_per_minute: tenant spent 90 tokens in the last 60 s and the "
                                      "request has 35, the limit is 100")
    q.settle_sample("t", first, 12)  # 40 held, 12 sampled: 28 back
    third = q.admit_sample("t", 0, _sample(5, 1, 30), context_length=64)  # 62 + 35
    q.settle_sample("t", first, 0)  # settled once only
    with pytest.raises(ResourceExhausted, match="the request has 123 tokens, more than the limit of 100 per minute"):
        q.admit_sample("t", 0, _sample(5, 2, None), context_length=64)  # no max_tokens: 5 + 2 x (64 - 5)
    now[0] += 60.0  # first, second and third leave the window; second's give-back has nothing left to give
    fourth = q.admit_sample("t", 0, _sample(50, 1, 50), context_length=64)
    q.settle_sample("t", second, 0)
    q.settle_sample("t", third, 0)
    with pytest.raises(ResourceExhausted, match="tenant spent 100 tokens"):
        q.admit_sample("t", 0, _sample(1, 1, 1), context_length=64)
    q.settle_sample("t", fourth, 20)
    q.admit_sample("t", 0, _sample(1, 1, 29), context_length=64)  # 70 + 30
    q.settle_sample("u", None, 7)  # admitted before a restart: its sampled tokens are charged when it ends
    with pytest.raises(ResourceExhausted, match="tenant spent 7 tokens"):
        q.admit_sample("u", 0, _sample(1, 1, 93), context_length=64)


def _finished(store: FutureStore, tenant: str, message_bytes: int) -> str:
    entry = store.create(tenant)
    store.complete(entry, pb.FutureResult(error=pb.Error(code="Internal", message="x" * message_bytes)))
    return entry.request_id


def test_finished_results_are_kept_by_bytes_oldest_first_and_an_expired_one_says_so() -> None:
    dropped: list[str] = []
    one = pb.FutureResult(request_id="req-" + "0" * 32, done=True, error=pb.Error(code="Internal", message="x" * 1000))
    store = FutureStore(keep_done=100, keep_bytes=one.ByteSize() * 5 // 2,
                        on_drop=lambda e: dropped.append(e.request_id))
    ids = [_finished(store, "t", 1000) for _ in range(4)]
    assert dropped == ids[:2] and len(store) == 2  # 2.5 results' bytes hold two
    with pytest.raises(NotFound) as e:
        store.get(ids[0], "t")
    assert e.value.message == (f"request_id {ids[0]!r} has expired: its result was dropped from the gateway's memory "
                               f"of finished results, which keeps the newest 100 of them and at most "
                               f"{store.keep_bytes} bytes (--keep-result-bytes); retrieve results soon after they "
                               "finish")
    with pytest.raises(NotFound, match=f"^unknown request_id {ids[0]!r}$"):  # another tenant learns nothing
        store.get(ids[0], "u")
    assert store.get(ids[3], "t").result.error.message == "x" * 1000
    big = _finished(store, "t", 10_000)  # alone over the bound: the newest result always stays
    assert len(store) == 1 and store.get(big, "t").result.done


def test_the_core_answers_an_expired_result_as_expired_unless_the_ledger_holds_it() -> None:
    async def scenario() -> None:
        core = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", keep_result_bytes=3000)
        recorded = core.ledger.futures.create("t")  # a sample's result, recorded in the ledger as it finishes
        core.store.add_op(Operation(recorded.request_id, "t", "sess:sample:0", None, "sample", b""))
        result = pb.FutureResult(error=pb.Error(code="Internal", message="y" * 1000))
        core.ledger.finish(recorded, result)
        answered = core.ledger.answered("t", pb.FutureResult(error=pb.Error(code="Internal", message="z" * 1000)))
        for _ in range(3):  # answered at once (kept in memory only): they push the first two out
            core.ledger.answered("t", pb.FutureResult(error=pb.Error(code="Internal", message="w" * 1000)))
        assert (await core.ledger.retrieve("t", recorded.request_id, 0.0)).error.message == "y" * 1000
        with pytest.raises(NotFound, match=f"request_id {answered!r} has expired"):
            await core.ledger.retrieve("t", answered, 0.0)
        await core.close()

    asyncio.run(scenario())


def test_session_search_reads_at_most_max_scanned_sessions_for_a_page() -> None:
    sessions = [Session(f"s{i:05d}", "t", {}, created_at=10_000.0 - i) for i in range(3 * MAX_SCANNED)]
    sessions[MAX_SCANNED + 7].display_name = "wanted"
    place = {s.session_id: i for i, s in enumerate(sessions)}
    read = [0]

    def page(after: tuple[float, str] | None, n: int) -> list[Session]:
        start = 0 if after is None else place[after[1]] + 1
        read[0] += len(batch := sessions[start:start + n])
        return batch

    query = SessionQuery.build(display_name="wanted", limit=5)
    found, last = search(query, page, None)
    assert (found, last, read[0]) == ([], sessions[MAX_SCANNED - 1], MAX_SCANNED)  # a page of none, and a cursor
    found, last = search(query, page, (last.created_at, last.session_id))
    assert found == [sessions[MAX_SCANNED + 7]] and last is sessions[2 * MAX_SCANNED - 1]
    found, last = search(query, page, (last.created_at, last.session_id))
    assert (found, last) == ([], sessions[-1])
    assert search(query, page, (last.created_at, last.session_id)) == ([], None)


def test_a_finished_session_and_its_sampling_sessions_leave_the_gateways_memory() -> None:
    async def scenario() -> None:
        core = GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1",
                           quotas=Quotas(QuotaConfig(TenantQuotas(max_sessions=2))))
        kept, done = core.book.create("t", {}), core.book.create("t", {})
        with pytest.raises(ResourceExhausted, match="quota max_sessions: tenant has 2 open sessions, the limit is 2"):
            core.book.create("t", {})
        sampler = f"{done}:sample:{core.store.number(done, 'next_sampler', None)}"
        core.store.put_sampling(SamplingSession(sampler, "t", "lathe/tiny-llama", "", 0.0))
        assert core.sampling.get("t", sampler) and core.store.open_sessions("t") == (2, 1)
        core.book.finish("t", done, "success")
        assert done not in core.book.sessions and sampler not in core.book.sampling and kept in core.book.sessions
        assert core.store.open_sessions("t") == (1, 0)
        assert core.book.get("t", done).finished == "success"  # read from the database again when asked for
        core.book.create("t", {})
        await core.close()

    asyncio.run(scenario())


def test_a_session_not_heard_from_expires_on_every_replica_and_its_heartbeat_answers_gone(tmp_path: Path) -> None:
    """The official SDK never finishes a session: one not heard from for ``session_idle_s`` is finished when its
    tenant next opens a session, and frees its place under ``max_sessions``. A heartbeat through either of two
    gateway replicas over one database keeps a session alive; one to an expired session answers SessionGone,
    even through the replica that still held it open in memory."""
    async def scenario() -> None:
        now = [1000.0]
        url = f"sqlite:///{tmp_path}/control.db"

        def replica() -> GatewayCore:
            return GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", store=ControlStore(StoreConfig(url)),
                               quotas=Quotas(QuotaConfig(TenantQuotas(max_sessions=2))), session_idle_s=100.0,
                               clock=lambda: now[0])

        a, b = replica(), replica()
        alive, idle = a.book.create("t", {}), a.book.create("t", {})
        assert not b.book.get("t", idle).finished  # b holds it, open
        with pytest.raises(ResourceExhausted, match="quota max_sessions: tenant has 2 open sessions"):
            a.book.create("t", {})
        now[0] += 90
        b.book.heartbeat("t", alive)  # heard through the other replica: recorded in the database
        now[0] += 20  # idle: 110 s unheard; alive: 20 s
        third = a.book.create("t", {})
        assert a.store.get_session(idle).finished == "expired: not heard from for 100 s"
        assert not a.store.get_session(alive).finished and idle not in a.book.sessions
        assert a.store.open_sessions("t")[0] == 2  # alive and third
        with pytest.raises(SessionGone, match=re.escape(f"session {idle!r} has finished (expired: not heard from")):
            b.book.heartbeat("t", idle)
        assert b.book.get("t", idle).finished and not b.book.get("t", third).finished
        with pytest.raises(ValueError, match="session_idle_s = 0 must be > 0"):
            GatewayCore("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", session_idle_s=0)
        await a.close()
        await b.close()

    asyncio.run(scenario())
