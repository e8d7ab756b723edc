"""A 512 MiB training state saves and loads through a real ``python -m lathe.checkpoints`` process, streamed: the
bytes come back identical, and the service's peak memory, reset just before, grows by a fraction of the state
while it moves (a whole-state message or buffer would grow it by the state's size; so would one over the 1 GiB
message limit both sides set, which streaming never sends)."""

from __future__ import annotations

import hashlib
import mmap
import os
import subprocess
from pathlib import Path

import pytest
from test_checkpoints_process import RUN, server  # noqa: F401 - the fixture

from lathe.checkpoints.client import CheckpointsClient

STATE_BYTES = 512 << 20
BLOCK = 64 << 20


def _write_state(path: Path) -> str:
    """Write ``STATE_BYTES`` of incompressible bytes (a random block, each copy stamped with its index) quickly;
    returns their sha256."""
    block, sha = bytearray(os.urandom(BLOCK)), hashlib.sha256()
    with path.open("wb") as f:
        for i in range(STATE_BYTES // BLOCK):
            block[:8] = i.to_bytes(8, "little")
            f.write(block)
            sha.update(block)
    return sha.hexdigest()


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _status_bytes(pid: int, field: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _reset_peak_rss(pid: int) -> int:
    """Set the process's peak resident size (VmHWM) to its current one; returns that."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_bytes(pid, "VmHWM")


@pytest.mark.slow
def test_a_512_mib_state_saves_and_loads_streamed(server: tuple[subprocess.Popen, str, Path],  # noqa: F811
                                                tmp_path: Path) -> None:
    proc, address, _ = server
    source = tmp_path / "optimizer.safetensors"
    want = _write_state(source)
    before = _reset_peak_rss(proc.pid)
    with CheckpointsClient(address) as client, source.open("rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as state:
        path = client.put(tenant="alice", run_id=RUN, kind="weights", name="big",
                          files={"optimizer.safetensors": state, "trainer_state.json": b"{}"})
        info = client.download(tenant="alice", path=path, directory=tmp_path / "back")
    assert info.size_bytes == STATE_BYTES + 2
    assert _sha256(tmp_path / "back" / "optimizer.safetensors") == want
    assert (tmp_path / "back" / "trainer_state.json").read_bytes() == b"{}"
    grew = _status_bytes(proc.pid, "VmHWM") - before
    assert grew < STATE_BYTES // 4, f"the service grew by {grew >> 20} MiB moving a {STATE_BYTES >> 20} MiB state"
