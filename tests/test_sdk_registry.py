"""Lathe's SDK over gRPC for what tinker 0.38's clients add beyond training and sampling: sessions (display name,
listing, search, final status), whoami, storage usage, weights info, samplers, copies, TTL, publishing and external
weights. Each runs against real processes, and where the official SDK asks the HTTP door the same question about
the same object, both answers are compared field for field (both doors call the same core)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
import tinker
from tinker import types as ttypes

import lathe
from lathe.errors import InvalidArgument, NotFound
from lathe.registry_types import SessionSearchRequest, SessionStatusQuery
from lathe.stack import Stack
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
KEY, OTHER = "tml-sdk-registry", "tml-sdk-registry-other"


def _datum() -> lathe.Datum:
    return next_token_datum([3, 9, 27, 81, 243, 11, 33, 99])


@pytest.fixture(scope="module")
def trained(stack: Stack) -> Iterator[tuple[lathe.ServiceClient, lathe.TrainingClient, str]]:
    """A run of one step under KEY, saved for sampling: (service client, training client, sampler path)."""
    sc = lathe.ServiceClient(stack.gateway, KEY, display_name="registry-run", user_metadata={"exp": "r"})
    tc = sc.create_lora_training_client(BASE, rank=4, train_unembed=False)
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
    yield sc, tc, tc.save_weights_for_sampler("s1").result().path
    sc.close()


def _official(stack: Stack, key: str = KEY) -> tinker.RestClient:
    return tinker.RestClient(base_url=stack.http_url, api_key=key)


def test_sessions_answer_alike_on_both_doors_and_close_records_the_status(stack: Stack, trained: tuple) -> None:
    sc, tc, _ = trained
    rc, official = sc.create_rest_client(), _official(stack)
    session_id = tc.model_id.rpartition(":train:")[0]
    mine = rc.get_session(session_id).result()
    theirs = official.get_session(session_id).result()
    assert (mine.training_run_ids, mine.user_metadata, mine.display_name) == ([tc.model_id], {"exp": "r"},
                                                                             "registry-run")
    assert (mine.training_run_ids, mine.sampler_ids, mine.user_metadata, mine.display_name) == (
        theirs.training_run_ids, theirs.sampler_ids, theirs.user_metadata, theirs.display_name)
    assert session_id in rc.list_sessions().result().sessions
    assert rc.list_sessions(limit=5).result().sessions == official.list_sessions(limit=5).result().sessions

    found = rc.search_sessions(SessionSearchRequest(display_name="registry-run")).result()
    assert [s.session_id for s in found.sessions] == [session_id]
    official_found = official.search_sessions(ttypes.SessionSearchRequest(display_name="registry-run")).result()
    a, b = found.sessions[0], official_found.sessions[0]
    assert (a.session_id, a.owner, a.status.type, a.checkpoints_count, a.checkpoint_storage_bytes, a.user_metadata,
            a.display_name, a.created_at) == (b.session_id, b.owner, b.status.type, b.checkpoints_count,
                                              b.checkpoint_storage_bytes, b.user_metadata, b.display_name,
                                              b.created_at)
    assert a.checkpoints_count == 1 and a.checkpoint_storage_bytes > 0  # the saved sampler weights
    assert rc.whoami().result().user_urn == a.owner
    # tinker's own request type is read as well
    assert rc.search_sessions(ttypes.SessionSearchRequest(session_id=session_id)).result().sessions[0].session_id \
        == session_id

    closing = lathe.ServiceClient(stack.gateway, KEY, display_name="to-close")
    closing.create_rest_client().whoami().result()
    closing.create_sampling_client(base_model=BASE)  # makes the session
    closing.close("errored", detail="a test")
    errored = rc.search_sessions(SessionSearchRequest(statuses=[SessionStatusQuery("client_finished",
                                                                                   ("errored",))])).result()
    assert [(s.display_name, s.status.reason) for s in errored.sessions] == [("to-close", "errored")]
    assert rc.search_sessions(SessionSearchRequest(display_name="to-close", statuses=[
        SessionStatusQuery("active")])).result().sessions == []
    with pytest.raises(NotFound):
        lathe.RestClient(base_url=stack.gateway, api_key=OTHER).get_session(session_id).result()
    with pytest.raises(InvalidArgument, match="project_ids"):
        rc.search_sessions(SessionSearchRequest(project_ids=["p"])).result()


def test_storage_weights_info_and_sampler_match_the_official_sdks_answers(stack: Stack, trained: tuple) -> None:
    sc, tc, path = trained
    rc, official = sc.create_rest_client(), _official(stack)
    usage = rc.get_current_checkpoint_storage_usage().result()
    admin = tinker.AdminClient(base_url=stack.http_url, api_key=KEY)
    theirs = admin.get_current_checkpoint_storage_usage().result()
    assert [(r.org_user_urn, r.user_name, r.checkpoint_count, r.size_bytes, r.size_gigabytes) for r in usage.data] \
        == [(r.org_user_urn, r.user_name, r.checkpoint_count, r.size_bytes, r.size_gigabytes) for r in theirs.data]
    assert usage.data[0].checkpoint_count >= 1

    info, their_info = rc.get_weights_info_by_tinker_path(path).result(), \
        official.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp, info.train_attn, info.train_unembed,
            info.optimizer_config.type) == (their_info.base_model, their_info.is_lora, their_info.lora_rank,
                                            their_info.train_mlp, their_info.train_attn, their_info.train_unembed,
                                            their_info.optimizer_config.type)
    assert (info.base_model, info.lora_rank, info.train_unembed) == (BASE, 4, False)
    assert tc.get_info().optimizer_config.type == "adamw"

    sampler = tc.create_sampling_client(path)
    got, their_sampler = rc.get_sampler(sampler.sampling_session_id).result(), \
        official.get_sampler(sampler.sampling_session_id).result()
    assert (got.sampler_id, got.base_model, got.model_path) == (their_sampler.sampler_id, their_sampler.base_model,
                                                                their_sampler.model_path)
    assert got.model_path == path

    other = lathe.RestClient(base_url=stack.gateway, api_key=OTHER)
    for call in (lambda: other.get_weights_info_by_tinker_path(path), lambda: other.copy_weights(path),
                 lambda: other.set_checkpoint_ttl_from_tinker_path(path, 3600),
                 lambda: other.publish_checkpoint_from_tinker_path(path),
                 lambda: other.get_sampler(sampler.sampling_session_id)):
        with pytest.raises(NotFound):
            call().result()
    assert other.get_current_checkpoint_storage_usage().result().data == []
    with pytest.raises(InvalidArgument, match="project_id"):
        rc.get_current_checkpoint_storage_usage(project_id="p").result()
    with pytest.raises(InvalidArgument, match="project_id"):
        rc.list_training_runs(project_id="p")
    with pytest.raises(InvalidArgument, match="project_id"):
        lathe.ServiceClient(stack.gateway, KEY, project_id="p")
    with pytest.raises(InvalidArgument, match="kind = 'live': a sampling client is 'snapshot'"):
        tc.save_weights_and_get_sampling_client(kind="live")  # inflight clients: tests/test_inflight.py


def test_copy_ttl_and_publish_through_grpc_show_in_the_official_listing(stack: Stack, trained: tuple) -> None:
    sc, _, path = trained
    rc, official = sc.create_rest_client(), _official(stack)
    copied = sc.copy_weights(path, ttl_seconds=7200).result()
    assert copied != path and copied.startswith("tinker://copy-") and copied.endswith("/sampler_weights/s1")
    listed = {c.tinker_path: c for c in official.list_user_checkpoints().result().checkpoints}
    assert listed[copied].size_bytes == listed[path].size_bytes and listed[copied].expires_at is not None
    tokens = {p: list(sc.create_sampling_client(p).sample(lathe.ModelInput.from_ints([5, 17, 42]), 1,
                                                           lathe.SamplingParams(max_tokens=5, seed=3, stop=[]))
                      .result().sequences[0].tokens) for p in (path, copied)}
    assert tokens[path] == tokens[copied]  # the same weights at the new path

    rc.set_checkpoint_ttl_from_tinker_path(copied, None).result()
    rc.publish_checkpoint_from_tinker_path(path).result()
    listed = {c.tinker_path: c for c in official.list_user_checkpoints().result().checkpoints}
    assert listed[copied].expires_at is None and listed[path].public and not listed[copied].public
    rc.unpublish_checkpoint_from_tinker_path(path).result()
    assert not {c.tinker_path: c for c in official.list_user_checkpoints().result().checkpoints}[path].public
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        rc.set_checkpoint_ttl_from_tinker_path(copied, 0).result()


def test_an_external_export_through_grpc_downloads_the_same_bytes_as_the_official_sdks_urls(
        stack: Stack, trained: tuple) -> None:
    sc, tc, _ = trained
    rc, official = sc.create_rest_client(), _official(stack)
    saved = tc.save_weights_external("ext").result()
    assert saved.path == f"tinker://{tc.model_id}/external_weights/ext" and saved.type == "save_weights_external"
    mine, theirs = rc.get_external_weights_urls(saved.path).result(), \
        official.get_external_weights_urls(saved.path).result()
    assert set(mine.urls) == set(theirs.urls) and "adapter_config.json" in mine.urls
    for name in mine.urls:
        with urllib.request.urlopen(mine.urls[name]) as a, urllib.request.urlopen(theirs.urls[name]) as b:
            assert a.read() == b.read()
    with pytest.raises(NotFound):
        lathe.RestClient(base_url=stack.gateway, api_key=OTHER).get_external_weights_urls(saved.path).result()
