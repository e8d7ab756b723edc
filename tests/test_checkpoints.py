"""The checkpoints core (no network): round trips, crash atomicity, overwrite, TTL, tenants, paths, listing."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from lathe.checkpoints.layout import CheckpointInfo, tenant_segment
from lathe.checkpoints.paths import CheckpointPath
from lathe.checkpoints.service import CheckpointService
from lathe.checkpoints.store import LocalDirStore, ObjectStore, open_store
from lathe.errors import AlreadyExists, Internal, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

RUN = "sess-1f2e:train:0"
PATH = f"tinker://{RUN}/weights/ckpt1"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class CrashingStore:
    """Delegates to ``inner`` but raises on the ``crash_at``-th mutation (put or delete, counted from 0)."""

    def __init__(self, inner: ObjectStore, crash_at: int) -> None:
        self.inner, self.crash_at, self.mutations = inner, crash_at, 0

    def _tick(self) -> None:
        if self.mutations == self.crash_at:
            raise OSError(f"injected crash at mutation {self.crash_at}")
        self.mutations += 1

    def put(self, key: str, data: bytes) -> None:
        self._tick()
        self.inner.put(key, data)

    def put_stream(self, key: str, chunks: Iterable[bytes]) -> None:
        self._tick()
        self.inner.put_stream(key, chunks)

    def delete(self, key: str) -> None:
        self._tick()
        self.inner.delete(key)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_stream(self, key: str) -> Iterator[bytes]:
        return self.inner.get_stream(key)

    def keys(self, prefix: str) -> list[str]:
        return self.inner.keys(prefix)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path) -> LocalDirStore:
    return LocalDirStore(tmp_path / "store")


@pytest.fixture
def svc(store: LocalDirStore, clock: Clock) -> CheckpointService:
    return CheckpointService(store, clock)


def files_v(version: int) -> dict[str, bytes]:
    return {"adapter_model.safetensors": os.urandom(1000 + version), "adapter_config.json": b'{"r": %d}' % version,
            "empty.bin": b""}


def put(svc: CheckpointService, files: dict[str, bytes], *, tenant: str = "alice", run_id: str = RUN,
        kind: str = "weights", name: str = "ckpt1", **kw: object) -> CheckpointInfo:
    return svc.put(tenant=tenant, run_id=run_id, kind=kind, name=name, files=files, **kw)


# ---- round trip and verification ----

def test_round_trip_returns_the_exact_bytes_and_info(svc: CheckpointService, clock: Clock) -> None:
    files = files_v(1)
    info = put(svc, files, metadata_json='{"base_model": "tiny"}')
    assert info.path == PATH
    assert (info.tenant, info.run_id, info.kind, info.name) == ("alice", RUN, "weights", "ckpt1")
    assert info.size_bytes == sum(len(b) for b in files.values())
    assert (info.created_at, info.expires_at) == (clock.t, 0.0)
    got_info, got = svc.get("alice", PATH)
    assert got == files and got_info == info == svc.stat("alice", PATH)


def test_get_detects_a_corrupted_file(svc: CheckpointService, store: LocalDirStore) -> None:
    put(svc, files_v(1))
    [key] = [k for k in store.keys("blobs/") if k.endswith("adapter_config.json")]
    store.put(key, b'{"r": 9}')  # same size, different bytes
    with pytest.raises(Internal, match="adapter_config.json.*corrupt"):
        svc.get("alice", PATH)


def test_manifest_records_sha256_of_each_file(svc: CheckpointService, store: LocalDirStore) -> None:
    files = files_v(1)
    put(svc, files)
    manifest = json.loads(store.get(f"manifests/{tenant_segment('alice')}/{RUN}/weights/ckpt1.json"))
    assert manifest["tenant"] == "alice"
    assert {n: f["sha256"] for n, f in manifest["files"].items()} == {
        n: hashlib.sha256(b).hexdigest() for n, b in files.items()}


# ---- atomicity ----

@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "overwrite"])
def test_a_crash_at_any_write_leaves_the_old_checkpoint_or_the_new_one(tmp_path: Path, previous: bool) -> None:
    old, new = files_v(1), files_v(2)
    # mutations of the save: 3 files, the run's owner record (first save of the run only), the manifest (the
    # commit point), then 3 deletes of the old files
    claim = 0 if previous else 1
    n_mutations = len(new) + claim + 1 + (len(old) if previous else 0)
    for crash_at in range(n_mutations + 1):
        clock = Clock()
        store = LocalDirStore(tmp_path / f"{previous}-{crash_at}")
        if previous:
            put(CheckpointService(store, clock), old)
        crashing = CheckpointService(CrashingStore(store, crash_at), clock)
        if crash_at < n_mutations:
            with pytest.raises(OSError, match="injected crash"):
                put(crashing, new, overwrite=True)
        else:
            put(crashing, new, overwrite=True)

        after = CheckpointService(store, clock)  # a fresh process over what is on disk
        committed = crash_at > len(new) + claim
        if committed:
            assert after.get("alice", PATH)[1] == new
        elif previous:
            assert after.get("alice", PATH)[1] == old
        else:
            with pytest.raises(NotFound):
                after.stat("alice", PATH)
        assert after.list("alice").total_count == (1 if committed or previous else 0)

        # once past the staging grace, the sweep leaves exactly the live checkpoint's files
        clock.t += after.staging_grace_s + 1
        after.sweep_expired()
        live = [k for k in store.keys("") if k.startswith("blobs/")]
        assert len(live) == (len(new) if committed or previous else 0), crash_at
        if committed or previous:
            assert after.get("alice", PATH)[1] == (new if committed else old)


def test_sweep_keeps_recent_uncommitted_files(svc: CheckpointService, store: LocalDirStore, clock: Clock) -> None:
    with pytest.raises(OSError):
        put(CheckpointService(CrashingStore(store, 2), clock), files_v(1))
    staged = store.keys("blobs/")
    assert len(staged) == 2
    clock.t += 10  # a save this young may still be running in another thread: keep its files
    assert svc.sweep_expired().orphan_files == 0
    assert store.keys("blobs/") == staged
    clock.t += svc.staging_grace_s
    assert svc.sweep_expired().orphan_files == 2
    assert store.keys("") == []


def test_local_store_put_is_atomic_when_the_rename_fails(store: LocalDirStore,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store.put("a/b", b"old")

    def boom(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        store.put("a/b", b"new")
    assert store.get("a/b") == b"old"
    assert os.listdir(store.root / "a") == ["b"]  # no temp file left behind


def test_local_store_keys_exists_delete(store: LocalDirStore) -> None:
    for k in ("x/1", "x/2", "xy/3", "z"):
        store.put(k, k.encode())
    assert store.keys("x/") == ["x/1", "x/2"]
    assert store.keys("x") == ["x/1", "x/2", "xy/3"]
    assert store.keys("") == ["x/1", "x/2", "xy/3", "z"]
    assert store.exists("z") and not store.exists("x") and not store.exists("nope")
    with pytest.raises(KeyError):
        store.get("nope")
    store.delete("xy/3")
    store.delete("xy/3")  # missing is fine
    assert not (store.root / "xy").exists()  # emptied directories are pruned
    for bad in ("../etc/passwd", "/abs", "a//b", ".hidden", ""):
        with pytest.raises(ValueError, match="object key"):
            store.put(bad, b"")


def test_open_store_by_location(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path / "d"), LocalDirStore)
    assert open_store(f"file://{tmp_path}/e").root == tmp_path / "e"
    with pytest.raises(ValueError, match="unknown scheme 'nope'"):
        open_store("nope://bucket")


# ---- overwrite ----

def test_overwrite_false_on_a_live_name_is_already_exists(svc: CheckpointService) -> None:
    put(svc, files_v(1))
    with pytest.raises(AlreadyExists, match=PATH):
        put(svc, files_v(2))
    assert svc.get("alice", PATH)[1]["adapter_config.json"] == b'{"r": 1}'


def test_overwrite_true_replaces_and_collects_the_old_files(svc: CheckpointService, store: LocalDirStore,
                                                           clock: Clock) -> None:
    put(svc, files_v(1))
    first_blobs = set(store.keys("blobs/"))
    clock.t += 5
    info = put(svc, files_v(2), overwrite=True, metadata_json='{"step": 2}')
    assert svc.get("alice", PATH)[1]["adapter_config.json"] == b'{"r": 2}'
    assert info.created_at == clock.t and info.metadata_json == '{"step": 2}'
    blobs = set(store.keys("blobs/"))
    assert len(blobs) == 3 and not blobs & first_blobs


def test_a_racing_save_of_the_same_name_is_rechecked_at_commit(store: LocalDirStore, clock: Clock) -> None:
    svc = CheckpointService(store, clock)

    class RacingStore(CrashingStore):
        """While the first save uploads its first file, a second save of the same name commits."""

        def put_stream(self, key: str, chunks: Iterable[bytes]) -> None:
            super().put_stream(key, chunks)
            if self.mutations == 1:
                put(svc, files_v(2))

    with pytest.raises(AlreadyExists, match=PATH):
        put(CheckpointService(RacingStore(store, crash_at=-1), clock), files_v(1))
    assert svc.get("alice", PATH)[1]["adapter_config.json"] == b'{"r": 2}'


# ---- TTL ----

def test_ttl_hides_then_sweep_deletes(svc: CheckpointService, store: LocalDirStore, clock: Clock) -> None:
    t0 = clock.t
    info = put(svc, files_v(1), ttl_seconds=10)
    keep = files_v(2)
    put(svc, keep, name="keep")
    assert info.expires_at == t0 + 10
    clock.t = t0 + 9.9
    assert svc.stat("alice", PATH) == info
    assert svc.sweep_expired().expired == 0
    clock.t = t0 + 10
    with pytest.raises(NotFound, match="expired"):
        svc.get("alice", PATH)
    assert [c.name for c in svc.list("alice").checkpoints] == ["keep"]
    assert svc.sweep_expired().expired == 1
    assert not any("/ckpt1" in k for k in store.keys(""))
    assert svc.get("alice", f"tinker://{RUN}/weights/keep")[1] == keep


def test_an_expired_name_can_be_saved_again_without_overwrite(svc: CheckpointService, clock: Clock) -> None:
    put(svc, files_v(1), ttl_seconds=1)
    clock.t += 2
    put(svc, files_v(2))
    assert svc.get("alice", PATH)[1]["adapter_config.json"] == b'{"r": 2}'


# ---- tenants ----

def test_another_tenants_checkpoint_is_not_found_as_a_missing_one_is(svc: CheckpointService) -> None:
    put(svc, files_v(1))
    missing = f"tinker://{RUN}/weights/never-saved"
    for call in (svc.get, svc.stat, svc.delete):
        with pytest.raises(NotFound) as theirs:
            call("mallory", PATH)
        with pytest.raises(NotFound) as absent:
            call("mallory", missing)
        assert str(theirs.value) == str(absent.value).replace(missing, PATH)  # no existence oracle
    assert svc.list("mallory", RUN).total_count == 0
    with pytest.raises(PermissionDenied, match=RUN):
        put(svc, files_v(2), tenant="mallory", name="squat")
    with pytest.raises(PermissionDenied, match=RUN):
        put(svc, files_v(2), tenant="mallory", overwrite=True)
    assert svc.list("mallory").total_count == 0
    assert svc.get("alice", PATH)[1]["adapter_config.json"] == b'{"r": 1}'


def test_unknown_and_deleted_are_not_found(svc: CheckpointService) -> None:
    with pytest.raises(NotFound, match=PATH):
        svc.stat("alice", PATH)
    put(svc, files_v(1))
    svc.delete("alice", PATH)
    with pytest.raises(NotFound, match=PATH):
        svc.get("alice", PATH)
    with pytest.raises(NotFound):
        svc.delete("alice", PATH)
    assert svc.store.keys("") == [f"runs/{RUN}.owner"]  # nothing of the checkpoint; the run stays alice's


# ---- validation ----

@pytest.mark.parametrize(("path", "message"), [
    ("s3://r/weights/n", "must start with 'tinker://'"),
    ("tinker://r/weights", "exactly 3 '/'-separated parts after the scheme, got 2"),
    ("tinker://r/weights/n/x", "got 4"),
    ("tinker://r/adapters/n", "kind 'adapters' must be one of 'weights', 'sampler_weights'"),
    ("tinker:///weights/n", "run_id is empty"),
    ("tinker://r/weights/", "name is empty"),
    ("tinker://r/weights/a b", "name 'a b' may contain only"),
    ("tinker://../weights/n", "run_id '..' may contain only"),
    ("tinker://r/sampler_weights/" + "n" * 129, "the limit is 128"),
])
def test_path_parsing_errors_name_the_bad_part(path: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        CheckpointPath.parse(path)
    assert repr(path) in err.value.message and message in err.value.message


def test_path_round_trip() -> None:
    p = CheckpointPath.parse("tinker://sess-1:train:0/sampler_weights/step-000100")
    assert (p.run_id, p.kind, p.name) == ("sess-1:train:0", "sampler_weights", "step-000100")
    assert str(p) == "tinker://sess-1:train:0/sampler_weights/step-000100"


@pytest.mark.parametrize(("kw", "message"), [
    ({"tenant": ""}, "tenant is empty"),
    ({"kind": "optimizer"}, "kind 'optimizer'"),
    ({"name": "a/b"}, "name 'a/b'"),
    ({"run_id": "r/1"}, "run_id 'r/1'"),
    ({"files": {}}, "files is empty"),
    ({"files": {"../x": b""}}, "file name '../x'"),
    ({"metadata_json": "[1]"}, "must be a JSON object"),
    ({"metadata_json": "{"}, "not valid JSON"),
    ({"ttl_seconds": -1}, "ttl_seconds = -1 must be in [0, "),
    ({"ttl_seconds": 2**62}, "ttl_seconds = 4611686018427387904 must be in [0, "),
])
def test_put_validates_its_arguments(svc: CheckpointService, kw: dict, message: str) -> None:
    args = {"tenant": "alice", "run_id": RUN, "kind": "weights", "name": "n", "files": {"f": b"x"}} | kw
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[")):
        svc.put(**args)
    assert svc.store.keys("") == []


# ---- listing ----

def test_list_orders_by_creation_and_paginates(svc: CheckpointService, clock: Clock) -> None:
    names = ["c", "a", "e", "b", "d"]
    for i, name in enumerate(names):
        clock.t += 1
        put(svc, {"f": b"%d" % i}, name=name, kind="sampler_weights" if i % 2 else "weights")
    clock.t += 1
    put(svc, {"f": b"x"}, run_id="sess-2:train:0", name="other-run")
    put(svc, {"f": b"x"}, tenant="bob", run_id="sess-3:train:0", name="bobs")

    page = svc.list("alice", RUN)
    assert [c.name for c in page.checkpoints] == names and page.total_count == 5
    page = svc.list("alice", RUN, limit=2, offset=1)
    assert [c.name for c in page.checkpoints] == ["a", "e"] and page.total_count == 5
    assert svc.list("alice", RUN, offset=4).checkpoints[0].name == "d"
    assert svc.list("alice", RUN, offset=9).checkpoints == []
    everything = svc.list("alice")
    assert [c.name for c in everything.checkpoints] == [*names, "other-run"]
    assert [c.name for c in svc.list("bob").checkpoints] == ["bobs"]
    assert svc.list("alice", "sess-9:train:0").total_count == 0
    with pytest.raises(InvalidArgument, match="limit"):
        svc.list("alice", limit=-1)


def test_an_export_obeys_the_byte_quota_and_a_refused_one_leaves_nothing(svc: CheckpointService,
                                                                         store: LocalDirStore) -> None:
    peft = {"adapter_model.safetensors": os.urandom(3000), "adapter_config.json": b'{"r": 4}'}
    src = put(svc, {**peft, "extra.bin": b"x" * 50}, kind="sampler_weights", name="snap").path
    used = 3000 + 8 + 50
    before = store.keys("")
    with pytest.raises(ResourceExhausted) as refused:
        svc.export(tenant="alice", source_path=src, name="out", max_tenant_bytes=used + 3000)
    assert refused.value.message.startswith(f"quota max_checkpoint_bytes: tenant has {used} bytes in live checkpoints "
                                            f"and saving tinker://{RUN}/external_weights/out would add 3008")
    assert store.keys("") == before  # no manifest, no file
    with pytest.raises(NotFound):
        svc.stat("alice", f"tinker://{RUN}/external_weights/out")

    info = svc.export(tenant="alice", source_path=src, name="out", max_tenant_bytes=used + 3008)
    assert svc.get("alice", info.path)[1] == peft
    # exporting the same name again replaces it, so its old bytes do not count against the new copy
    assert svc.export(tenant="alice", source_path=src, name="out", max_tenant_bytes=used + 3008).size_bytes == 3008
