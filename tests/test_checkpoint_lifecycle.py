"""Tinker's checkpoint lifecycle through the HTTP door with the official SDK (TTL change, publish and unpublish,
another tenant kept out), and the core calls under them."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
import tinker

from lathe.checkpoints.service import CheckpointService
from lathe.checkpoints.store import LocalDirStore
from lathe.stack import Stack

BASE = "lathe/tiny-llama"


def _entry(rc: tinker.RestClient, run_id: str, path: str) -> tinker.types.Checkpoint:
    [entry] = [c for c in rc.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path]
    return entry


def _unix(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


def test_ttl_change_and_publish_through_the_official_sdk(stack: Stack) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-life-alice")
    rc = tinker.RestClient(base_url=stack.http_url, api_key="tml-life-alice")
    tc = sc.create_lora_training_client(BASE, rank=4).result()
    path = tc.save_state("kept", ttl_seconds=3600).result().path
    run_id = tc.model_id
    first = _unix(_entry(rc, run_id, path).expires_at)
    assert first is not None

    before = time.time()
    rc.set_checkpoint_ttl_from_tinker_path(path, 7 * 86400).result()
    after = time.time()
    expires = _unix(_entry(rc, run_id, path).expires_at)
    assert before + 7 * 86400 - 1 <= expires <= after + 7 * 86400 + 1
    rc.set_checkpoint_ttl_from_tinker_path(path, None).result()  # None: never expires
    assert _entry(rc, run_id, path).expires_at is None

    assert _entry(rc, run_id, path).public is False
    for _ in range(2):  # again is a no-op (the SDK would retry a 409 for minutes)
        rc.publish_checkpoint_from_tinker_path(path).result()
        assert _entry(rc, run_id, path).public is True
    rc.unpublish_checkpoint_from_tinker_path(path).result()
    assert _entry(rc, run_id, path).public is False
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds = 0 must be in \[1, "):
        rc.set_checkpoint_ttl_from_tinker_path(path, 0).result()

    bob = tinker.RestClient(base_url=stack.http_url, api_key="tml-life-bob")
    for call in (lambda: bob.set_checkpoint_ttl_from_tinker_path(path, 3600),
                 lambda: bob.publish_checkpoint_from_tinker_path(path)):
        with pytest.raises(tinker.NotFoundError, match="not found"):
            call().result()
    entry = _entry(rc, run_id, path)  # bob changed nothing
    assert (entry.expires_at, entry.public) == (None, False)
    # the checkpoint is still whole: a new run loads it
    assert sc.create_training_client_from_state(path).result().model_id != run_id
    sc.close("success").result()


def test_set_ttl_and_public_rewrite_only_the_manifest(tmp_path: Path) -> None:
    now = [1000.0]
    svc = CheckpointService(LocalDirStore(tmp_path), clock=lambda: now[0])
    info = svc.put(tenant="alice", run_id="r", kind="weights", name="a", files={"f": b"payload"},
                   metadata_json=json.dumps({"k": 1}), ttl_seconds=6000)
    now[0] = 2000.0
    changed = svc.set_ttl("alice", info.path, 30)
    assert (changed.expires_at, changed.created_at, changed.metadata_json) == (2030.0, 1000.0, info.metadata_json)
    assert svc.set_public("alice", info.path, True).public
    assert svc.get("alice", info.path)[1] == {"f": b"payload"}
    assert svc.stat("alice", info.path) == replace(changed, public=True)
    now[0] = 2031.0
    assert svc.list("alice").checkpoints == []  # the new TTL is the one that counts
