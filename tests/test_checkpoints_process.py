"""``python -m lathe.checkpoints`` as a real process, driven through ``CheckpointsClient``."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lathe.checkpoints.client import CheckpointsClient
from lathe.errors import AlreadyExists, InvalidArgument, NotFound

READY_TIMEOUT_S = 30.0
RUN = "sess-9:train:0"


def wait_for_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of ``proc``, or fail after ``timeout_s`` (or if it exits first)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                line = proc.stdout.readline()
                if line:
                    return line.strip()
            if proc.poll() is not None:
                pytest.fail(f"lathe.checkpoints exited with {proc.returncode}: {proc.stderr.read()}")
    pytest.fail(f"no ready line from lathe.checkpoints within {timeout_s} s")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    root = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lathe.checkpoints", "--port", "0", "--host", "127.0.0.1", "--root", str(root),
         "--sweep-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = wait_for_line(proc, READY_TIMEOUT_S)
        prefix = "lathe.checkpoints listening on 127.0.0.1:"
        assert line.startswith(prefix), line
        assert int(line[len(prefix):]) > 0
        yield proc, line.rsplit(" ", 1)[1], root
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_process_serves_checkpoints_and_stops_on_sigterm(server: tuple[subprocess.Popen, str, Path]) -> None:
    proc, target, root = server
    big = os.urandom(5 << 20)  # over gRPC's 4 MiB default: the 1 GiB limit is set on both sides
    files = {"adapter_model.safetensors": big, "adapter_config.json": b"{}"}
    with CheckpointsClient(target) as client:
        path = client.put(tenant="alice", run_id=RUN, kind="sampler_weights", name="s1", files=files,
                          metadata_json='{"base_model": "tiny"}')
        assert path == f"tinker://{RUN}/sampler_weights/s1"
        assert client.get(tenant="alice", path=path) == files
        info = client.stat(tenant="alice", path=path)
        assert (info.tenant, info.kind, info.name, info.size_bytes) == ("alice", "sampler_weights", "s1", len(big) + 2)
        assert info.metadata_json == '{"base_model": "tiny"}' and info.expires_at == 0.0

        with pytest.raises(AlreadyExists, match=path):
            client.put(tenant="alice", run_id=RUN, kind="sampler_weights", name="s1", files=files)
        with pytest.raises(NotFound, match=f"{path} not found"):
            client.get(tenant="bob", path=path)
        with pytest.raises(NotFound, match="nope"):
            client.stat(tenant="alice", path=f"tinker://{RUN}/weights/nope")
        with pytest.raises(InvalidArgument, match="kind 'bogus'"):
            client.stat(tenant="alice", path=f"tinker://{RUN}/bogus/s1")

        # a checkpoint with a 1 s TTL disappears, and the periodic sweep removes its files
        client.put(tenant="alice", run_id=RUN, kind="weights", name="short", files={"f": b"x"}, ttl_seconds=1)
        page = client.list(tenant="alice", run_id=RUN)
        assert [c.name for c in page.checkpoints] == ["s1", "short"] and page.total_count == 2
        deadline = time.monotonic() + 10
        while any("short" in str(p) for p in root.rglob("*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any("short" in str(p) for p in root.rglob("*"))
        assert client.list(tenant="alice").total_count == 1

        client.delete(tenant="alice", path=path)
        with pytest.raises(NotFound):
            client.get(tenant="alice", path=path)
        assert client.list(tenant="alice").total_count == 0

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert "lathe.checkpoints stopped" in proc.stderr.read()
