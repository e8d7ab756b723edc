"""The S3 backend against a live SeaweedFS with auth: round trips, credentials, an S3 crash mid-save, TTL,
tenants, corruption and a state far bigger than one gRPC message, through a real checkpoints process."""

from __future__ import annotations

import io
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import urllib3

from lathe.checkpoints.client import CheckpointsClient
from lathe.checkpoints.layout import tenant_segment
from lathe.checkpoints.s3 import S3Config, S3Store
from lathe.checkpoints.seaweed import LocalS3
from lathe.checkpoints.service import CheckpointService
from lathe.errors import (
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from lathe.runtime.internal_auth import internal_channel
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from tests.s3_server import checkpoints_process

RUN = "sess-s3:train:0"
PATH = f"tinker://{RUN}/weights/ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    with LocalS3(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture(scope="module")
def client(s3: LocalS3) -> Iterator[CheckpointsClient]:
    with checkpoints_process(s3) as (_, target), CheckpointsClient(target, timeout_s=120) as c:
        yield c


def store(s3: LocalS3, prefix: str, **env: str) -> S3Store:
    return S3Store(S3Config.from_env(f"{s3.url}/{prefix}", {**s3.env(), **env}))


def state(seed: int, big: int = 9 << 20) -> dict[str, bytes]:
    """A training state: a multi-chunk file, a small one and an empty one."""
    return {"adapter_model.safetensors": os.urandom(big), "adapter_config.json": b'{"seed": %d}' % seed,
            "empty.bin": b""}


def test_round_trip_is_bit_exact_through_the_service(client: CheckpointsClient, s3: LocalS3,
                                                     tmp_path: Path) -> None:
    files = state(1)
    path = client.put(tenant="alice", run_id=RUN, kind="weights", name="rt", files=files,
                      metadata_json='{"base_model": "tiny"}')
    assert client.get(tenant="alice", path=path) == files
    seen: list[int] = []
    info = client.download(tenant="alice", path=path, directory=tmp_path / "dl", on_bytes=lambda n, _: seen.append(n))
    assert {p.name: p.read_bytes() for p in (tmp_path / "dl").iterdir()} == files
    assert sum(seen) == info.size_bytes == sum(map(len, files.values()))
    # the layout: one prefix per tenant and run, multipart for the big file, manifest last
    keys = sorted(o.object_name for o in s3.client().list_objects(s3.bucket, prefix="ckpt/", recursive=True))
    t = tenant_segment("alice")
    assert f"ckpt/manifests/{t}/{RUN}/weights/rt.json" in keys
    assert sum(k.startswith(f"ckpt/blobs/{t}/{RUN}/weights/rt/") for k in keys) == 3


def test_wrong_credentials_fail_clearly(s3: LocalS3) -> None:
    for env in ({"LATHE_S3_SECRET_KEY": "wrong"}, {"LATHE_S3_ACCESS_KEY": "nobody"}):
        svc = CheckpointService(store(s3, "ckpt", **env))
        with pytest.raises(PermissionDenied) as e:
            svc.put(tenant="alice", run_id=RUN, kind="weights", name="x", files={"f": b"1"})
        assert s3.endpoint in e.value.message and "'lathe'" in e.value.message and "access denied" in e.value.message
    with pytest.raises(InvalidArgument, match="LATHE_S3_ACCESS_KEY"):
        S3Config.from_env(s3.url, {"LATHE_S3_ENDPOINT": s3.endpoint})


def test_presigned_urls_are_signed_for_the_address_clients_reach(s3: LocalS3) -> None:
    """A URL carries the host it was signed for: with ``LATHE_S3_PUBLIC_ENDPOINT`` it names (and works at) that
    address and not the service's own; ``none`` hands out no URL, and ``locate`` then names none, with no expiry."""
    public = s3.endpoint.replace("127.0.0.1", "localhost")
    svc = CheckpointService(store(s3, "public", LATHE_S3_PUBLIC_ENDPOINT=public))
    path = svc.put(tenant="erin", run_id=RUN, kind="weights", name="pub", files={"a.bin": b"public bytes"}).path
    _, files, expires = svc.locate("erin", path, 60)
    url = files["a.bin"].url
    assert url.startswith(public + "/") and expires > 0
    assert urllib.request.urlopen(url).read() == b"public bytes"
    with pytest.raises(urllib.error.HTTPError) as refused:  # the host is part of the signature
        urllib.request.urlopen(url.replace(public, s3.endpoint))
    assert refused.value.code == 403

    hidden = CheckpointService(store(s3, "public", LATHE_S3_PUBLIC_ENDPOINT="none"))
    _, files, expires = hidden.locate("erin", path, 60)
    assert {n: (f.url, f.size) for n, f in files.items()} == {"a.bin": ("", 12)} and expires == 0.0
    with pytest.raises(InvalidArgument, match="public endpoint 's3.example.com' must be http://host"):
        store(s3, "public", LATHE_S3_PUBLIC_ENDPOINT="s3.example.com")


def test_a_corrupted_object_is_an_error_naming_its_key(client: CheckpointsClient, s3: LocalS3) -> None:
    path = client.put(tenant="alice", run_id=RUN, kind="weights", name="rot", files={"a.bin": b"x" * 1000})
    [key] = [o.object_name for o in s3.client().list_objects(s3.bucket, prefix="ckpt/blobs/", recursive=True)
             if "/rot/" in o.object_name]
    for rotten in (b"y" * 1000, b"x" * 1500):  # other bytes, then more of them than the manifest names
        s3.client().put_object(s3.bucket, key, io.BytesIO(rotten), len(rotten))
        with pytest.raises(Internal, match=f"{key.removeprefix('ckpt/')}.*corrupt \\({len(rotten)} bytes"):
            client.get(tenant="alice", path=path)


def test_a_client_that_cannot_reach_the_store_reads_through_the_service(client: CheckpointsClient) -> None:
    files = state(7)
    path = client.put(tenant="alice", run_id=RUN, kind="weights", name="detour", files=files)
    with CheckpointsClient(client.target) as detour:
        detour._http = urllib3.ProxyManager("http://127.0.0.1:9")  # every store URL now fails to connect
        assert detour.get(tenant="alice", path=path) == files  # all files read in parallel, then via GetStream
        assert not detour.direct_reads
        assert detour.get(tenant="alice", path=path) == files

def test_another_tenant_cannot_list_load_download_or_delete(client: CheckpointsClient, tmp_path: Path) -> None:
    path = client.put(tenant="alice", run_id=RUN, kind="weights", name="mine", files={"f": b"secret"})
    missing = f"tinker://{RUN}/weights/never"
    assert all(c.tenant != "bob" for c in client.list(tenant="bob").checkpoints)
    assert client.list(tenant="bob", run_id=RUN).total_count == 0
    calls = (lambda p: client.get(tenant="bob", path=p), lambda p: client.stat(tenant="bob", path=p),
             lambda p: client.delete(tenant="bob", path=p),
             lambda p: client.download(tenant="bob", path=p, directory=tmp_path))
    for call in calls:
        with pytest.raises(NotFound) as theirs:
            call(path)
        with pytest.raises(NotFound) as absent:
            call(missing)
        assert theirs.value.message == absent.value.message.replace(missing, path)
    assert client.get(tenant="alice", path=path) == {"f": b"secret"}
    assert list(tmp_path.iterdir()) == []


def test_ttl_expiry_removes_exactly_the_expired_checkpoints(s3: LocalS3) -> None:
    now = [1_700_000_000.0]
    svc = CheckpointService(store(s3, "ttl"), clock=lambda: now[0])
    for name, ttl in (("short", 10), ("long", 1000), ("forever", 0)):
        svc.put(tenant="alice", run_id=RUN, kind="weights", name=name, files={"w": name.encode()}, ttl_seconds=ttl)
    keys = svc.store.keys("")
    now[0] += 100
    swept = svc.sweep_expired()
    assert (swept.expired, swept.orphan_files) == (1, 0)
    assert svc.store.keys("") == [k for k in keys if "/short" not in k]
    assert {c.name for c in svc.list("alice", RUN).checkpoints} == {"long", "forever"}


def test_sigkill_of_s3_mid_save_keeps_the_previous_checkpoint(s3: LocalS3) -> None:
    with checkpoints_process(s3, prefix="crash") as (_, target), CheckpointsClient(target, timeout_s=120) as c:
        old = state(1)
        path = c.put(tenant="alice", run_id=RUN, kind="weights", name="ckpt", files=old)
        header = cpb.PutCheckpointRequest(tenant="alice", run_id=RUN, kind="weights", name="ckpt", overwrite=True)
        other = cpb.PutCheckpointRequest(tenant="alice", run_id=RUN, kind="weights", name="new")

        def messages(h: cpb.PutCheckpointRequest) -> Iterator[cpb.PutCheckpointChunk]:
            yield cpb.PutCheckpointChunk(header=h)
            for i in range(8):  # 32 MiB: several multipart parts; S3 dies after the second chunk
                if i == 2:
                    s3.kill()
                yield cpb.PutCheckpointChunk(chunk=cpb.FileChunk(file="adapter_model.safetensors",
                                                                 data=os.urandom(4 << 20)))
            yield cpb.PutCheckpointChunk(done=True)

        for h in (header, other):
            with pytest.raises(grpc.RpcError) as e:
                c._stub.PutStream(messages(h), timeout=120)
            error = from_rpc_error(e.value)
            assert isinstance(error, Unavailable) and "unavailable" in error.message and "retry" in error.message
            s3.restart()
        assert c.get(tenant="alice", path=path) == old
        with pytest.raises(NotFound):
            c.stat(tenant="alice", path=f"tinker://{RUN}/weights/new")
        assert [i.name for i in c.list(tenant="alice", run_id=RUN).checkpoints] == ["ckpt"]


@pytest.mark.slow
def test_a_state_of_300_mb_streams_through_the_service(s3: LocalS3) -> None:
    files = {"adapter_model.safetensors": os.urandom(200 << 20), "optimizer.safetensors": os.urandom(100 << 20)}
    size = sum(map(len, files.values()))
    with checkpoints_process(s3, prefix="big") as (proc, target), CheckpointsClient(target, timeout_s=600) as c:
        base = peak_rss(proc.pid)
        t0 = time.monotonic()
        path = c.put(tenant="alice", run_id=RUN, kind="weights", name="big", files=files)
        t1 = time.monotonic()
        assert c.get(tenant="alice", path=path) == files
        t2 = time.monotonic()
        peak = peak_rss(proc.pid)
    print(f"{size >> 20} MiB: save {size / 1e6 / (t1 - t0):.0f} MB/s, load {size / 1e6 / (t2 - t1):.0f} MB/s, "
          f"server peak RSS {peak >> 20} MiB (at start {base >> 20} MiB)")
    assert peak - base < size, f"the checkpoints server grew by {(peak - base) >> 20} MiB: it held the whole state"


def peak_rss(pid: int) -> int:
    """Bytes: the peak resident set of process ``pid`` so far."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) << 10


def test_concurrent_saves_each_commit(client: CheckpointsClient) -> None:
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            client.put(tenant="carol", run_id="sess-c:train:0", kind="sampler_weights", name=f"s{i}",
                       files={"w": bytes([i]) * (5 << 20)})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and client.list(tenant="carol").total_count == 3


def test_an_export_on_s3_holds_the_adapter_files_and_obeys_the_quota(client: CheckpointsClient, s3: LocalS3) -> None:
    """``Export`` through the process: the export's presigned URLs (what Tinker's download path hands out) and
    the client's read give the source's PEFT files byte for byte; a refused export leaves no object behind."""
    peft = {"adapter_model.safetensors": os.urandom(6 << 20), "adapter_config.json": b'{"r": 8, "peft_type": "LORA"}'}
    src = client.put(tenant="exporter", run_id="sess-x:train:0", kind="sampler_weights", name="snap",
                     files={**peft, "notes.txt": b"not exported"})
    stub = cpb_grpc.CheckpointsStub(internal_channel(client.target, []))

    def export(name: str, quota: int) -> cpb.CheckpointInfo:
        try:
            return stub.Export(cpb.ExportRequest(tenant="exporter", source_path=src, name=name, max_tenant_bytes=quota))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    used = sum(map(len, peft.values())) + len(b"not exported")
    with pytest.raises(ResourceExhausted, match=f"tenant has {used} bytes in live checkpoints"):
        export("refused", used + 100)
    prefix = f"ckpt/blobs/{tenant_segment('exporter')}/sess-x:train:0/external_weights/"
    assert list(s3.client().list_objects(s3.bucket, prefix=prefix, recursive=True)) == []

    info = export("out", 2 * used)
    located = stub.Locate(cpb.LocateRequest(tenant="exporter", path=info.path, expires_in_s=60))
    assert {n: f.url.startswith(s3.endpoint) for n, f in located.files.items()} == dict.fromkeys(peft, True)
    assert {n: urllib.request.urlopen(f.url).read() for n, f in located.files.items()} == peft
    assert client.get(tenant="exporter", path=info.path) == peft
