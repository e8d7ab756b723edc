"""The Tinker HTTP door's registry routes (session search, ``auth/token``, checkpoint storage usage, ``copy_weights``)
and a run's optimizer family (info, weights info, a rebuild after a trainer restart), each driven through the
official ``tinker`` SDK's own method against real processes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib._jwt_auth import JwtAuthProvider, jwt_claims
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from lathe.stack import Stack
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]
WAIT_S = 60.0


def _http(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": key}, timeout=WAIT_S)


def _datum() -> types.Datum:
    return next_token_datum([3, 9, 27, 81, 243, 11, 33, 99], types)


def _saved_sampler(sc: tinker.ServiceClient, name: str) -> str:
    """A run of one AdamW step, saved as sampler weights; the path."""
    tc = sc.create_lora_training_client(BASE, rank=4).result()
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return tc.save_weights_for_sampler(name).result().path


def _tokens(sc: tinker.ServiceClient, path: str) -> list[int]:
    sampler = sc.create_sampling_client(model_path=path)
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6, seed=5, stop=[]))
    return list(out.result().sequences[0].tokens)


def test_session_search_filters_by_metadata_and_status_and_pages_newest_first(stack: Stack) -> None:
    key = "tml-search"
    with _http(stack, key) as http:
        made = [http.post("/create_session", json={"user_metadata": {"exp": "a" if i < 3 else "b"}}).json()
                ["session_id"] for i in range(4)]
        assert http.post(f"/sessions/{made[0]}/finish", json={"reason": {"type": "errored"}}).status_code == 200
    rc = tinker.RestClient(base_url=stack.http_url, api_key=key)
    first = rc.search_sessions(types.SessionSearchRequest(user_metadata={"exp": "a"}, limit=2)).result()
    assert [s.session_id for s in first.sessions] == [made[2], made[1]]  # newest first, "b" left out
    assert first.next_cursor is not None and first.next_cursor.last_session_id == made[1]
    rest = rc.search_sessions(types.SessionSearchRequest(user_metadata={"exp": "a"}, limit=2,
                                                         cursor=first.next_cursor)).result()
    assert [s.session_id for s in rest.sessions] == [made[0]] and rest.next_cursor is None
    assert rest.sessions[0].status.type == "client_finished" and rest.sessions[0].status.reason.type == "errored"
    active = rc.search_sessions(types.SessionSearchRequest(
        user_metadata={"exp": "a"}, statuses=[types.ActiveSessionStatusQuery()])).result()
    assert [s.session_id for s in active.sessions] == [made[2], made[1]]
    one = rc.search_sessions(types.SessionSearchRequest(session_id=made[3])).result()
    assert [(s.session_id, s.user_metadata, s.checkpoints_count) for s in one.sessions] == [(made[3], {"exp": "b"}, 0)]
    other = tinker.RestClient(base_url=stack.http_url, api_key="tml-search-other")
    assert other.search_sessions(types.SessionSearchRequest(session_id=made[3])).result().sessions == []
    with pytest.raises(tinker.BadRequestError, match="project_ids"):
        rc.search_sessions(types.SessionSearchRequest(project_ids=["p1"])).result()


def test_the_sdks_token_exchange_proceeds_with_a_token_naming_the_caller(stack: Stack) -> None:
    rc = tinker.RestClient(base_url=stack.http_url, api_key="tml-token")
    holder = rc.holder
    provider = JwtAuthProvider(lambda: holder.aclient(ClientConnectionPoolType.TRAIN))

    async def exchange() -> str:
        try:
            return await provider.get_token()  # the SDK's own exchange: /auth/token, then its claims read
        finally:
            await provider.close()

    token = holder.run_coroutine_threadsafe(exchange()).result()
    claims = jwt_claims(token)
    assert claims["iss"] == "lathe" and claims["sub"].startswith("t-")  # open mode: the key's tenant
    assert time.time() < claims["exp"] <= time.time() + 3600
    with _http(stack, token) as http:  # Lathe keeps to API keys: the token is no credential
        assert http.get("/training_runs").status_code == 401


def test_storage_usage_and_copy_weights_of_a_tenants_checkpoints(stack: Stack) -> None:
    key = "tml-copy"
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key=key)
    rc = tinker.RestClient(base_url=stack.http_url, api_key=key)
    admin = tinker.AdminClient(base_url=stack.http_url, api_key=key)
    assert admin.get_current_checkpoint_storage_usage().result().data == []  # nothing saved yet
    source = _saved_sampler(sc, "src")

    copied = rc.copy_weights(source, "any-project", ttl_seconds=7200).result()
    assert copied != source and copied.endswith("/sampler_weights/src")
    assert _tokens(sc, copied) == _tokens(sc, source)  # the same weights at the new path
    listed = {c.tinker_path: c for c in rc.list_user_checkpoints().result().checkpoints}
    assert set(listed) == {source, copied} and listed[copied].size_bytes == listed[source].size_bytes
    assert listed[copied].expires_at is not None and listed[source].expires_at is None

    with _http(stack, key) as http:  # one idempotency key, as the SDK keeps across retries: one copy
        body, headers = {"source_path": source, "destination_project_id": "p"}, {"X-Idempotency-Key": "k-1"}
        answers = [http.post("/copy_weights", json=body, headers=headers) for _ in range(2)]
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        again = [r.json()["tinker_path"] for r in answers]
        with ThreadPoolExecutor(2) as pool:  # two attempts at once: whichever commits second answers the first's
            both = list(pool.map(lambda _: http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": "k-2"}),
                                 range(2)))
        assert [r.status_code for r in both] == [200, 200], [r.text for r in both]
        raced = {r.json()["tinker_path"] for r in both}
    assert again[0] == again[1] and again[0] not in (source, copied)
    assert len(raced) == 1 and raced.isdisjoint({source, copied, again[0]})
    usage = admin.get_current_checkpoint_storage_usage().result()
    assert [(row.checkpoint_count, row.size_bytes) for row in usage.data] == [(4, 4 * listed[source].size_bytes)]
    assert usage.data[0].size_gigabytes == pytest.approx(usage.data[0].size_bytes / 1e9)
    with pytest.raises(tinker.NotFoundError):  # another tenant's checkpoint is missing, for copying too
        tinker.RestClient(base_url=stack.http_url, api_key="tml-copy-other").copy_weights(source, "p").result()


def test_a_dimuon_run_reports_its_family_and_keeps_it_across_a_trainer_restart(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-dimuon")
    tc = sc.create_lora_training_client(BASE, rank=4, optimizer=types.DimuonOptimizerConfig()).result()
    assert tc.get_info().optimizer_config.type == "dimuon"
    step = types.DimuonParams(learning_rate=0.02)
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(step).result()
    stack.kill("trainer")  # before any save: no recovery snapshot, the run is rebuilt from its record and ledger
    stack.restart("trainer")
    tc.forward_backward([_datum()], "cross_entropy").result()  # rebuilds the run on the restarted trainer
    tc.optim_step(step).result()  # a run rebuilt as AdamW refuses DimuonParams
    saved = tc.save_state("d1").result().path
    rc = tinker.RestClient(base_url=stack.http_url, api_key="tml-dimuon")
    assert rc.get_weights_info_by_tinker_path(saved).result().optimizer_config.type == "dimuon"
