"""The checkpoints client's retries, against a real ``python -m lathe.checkpoints`` killed with SIGKILL and
started again on its port: saves (as a whole) and loads ride over the restart; a save whose answer was lost
is recognised by its content and a real conflict is not masked; a service that stays away fails the call
with ``Unavailable`` naming the service, the call and the retry window."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lathe.checkpoints.client import CheckpointsClient, Retry
from lathe.errors import AlreadyExists, Unavailable
from tests.test_checkpoints_process import READY_TIMEOUT_S, wait_for_line

RUN = "sess-7:train:0"
FILES = {"adapter_model.safetensors": os.urandom(5 << 20), "trainer_state.json": b'{"step": 3}'}


class Server:
    """A checkpoints process over ``root`` that can be killed and started again on the same port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.procs = root, 0, []

    def start(self) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lathe.checkpoints", "--host", "127.0.0.1", "--port", str(self.port),
             "--root", str(self.root)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        self.port = int(wait_for_line(proc, READY_TIMEOUT_S).rpartition(":")[2])
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.procs[-1].kill()
        self.procs[-1].wait()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "store")
    yield s
    for proc in s.procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_save_and_a_load_ride_over_a_restart_on_the_same_port(server: Server) -> None:
    target = server.start()
    with CheckpointsClient(target, retry=Retry(retry_for_s=60.0)) as c:
        first = c.put(tenant="alice", run_id=RUN, kind="weights", name="before", files=FILES)
        server.kill()
        threading.Timer(0.5, server.start).start()  # comes back while the save below is being retried
        path = c.put(tenant="alice", run_id=RUN, kind="weights", name="after", files=FILES, metadata_json='{"a": 1}')
        assert path == f"tinker://{RUN}/weights/after"
        server.kill()
        threading.Timer(0.5, server.start).start()
        assert c.get(tenant="alice", path=first) == FILES
        assert c.stat(tenant="alice", path=path).metadata_json == '{"a": 1}'
    assert len(server.procs) == 3


def test_a_save_whose_answer_was_lost_is_found_by_its_content(server: Server) -> None:
    with CheckpointsClient(server.start(), retry=Retry(retry_for_s=10.0)) as c:
        real, calls = c._call, []

        def answer_lost(method: Any, request: Any) -> Any:  # the first save lands, then its connection breaks
            calls.append(method)
            if len(calls) == 1:
                real(method, request)
                raise Unavailable("connection reset")
            return real(method, request)

        c._call = answer_lost
        path = c.put(tenant="alice", run_id=RUN, kind="weights", name="s", files=FILES, metadata_json='{"b": 2}')
        assert path == f"tinker://{RUN}/weights/s" and len(calls) >= 2
        assert c.get(tenant="alice", path=path) == FILES

        def never_arrived(method: Any, request: Any) -> Any:  # the first try fails before reaching the service
            calls.append(method)
            if len(calls) == 1:
                raise Unavailable("connection refused")
            return real(method, request)

        calls.clear()
        c._call = never_arrived
        other = {**FILES, "trainer_state.json": b'{"step": 4}'}
        with pytest.raises(AlreadyExists, match=f"checkpoint tinker://{RUN}/weights/s already exists"):
            c.put(tenant="alice", run_id=RUN, kind="weights", name="s", files=other, metadata_json='{"b": 2}')
        assert c.get(tenant="alice", path=path) == FILES


def test_a_service_that_stays_away_fails_with_unavailable_naming_it(server: Server) -> None:
    target = server.start()
    server.kill()
    with CheckpointsClient(target, retry=Retry(retry_for_s=0.3)) as c, pytest.raises(Unavailable) as e:
        c.stat(tenant="alice", path=f"tinker://{RUN}/weights/s")
    assert e.value.message.startswith(f"checkpoints service at {target} stayed unavailable for 0.3 s (retry_for_s) "
                                      f"while trying to stat tinker://{RUN}/weights/s: ")
    with pytest.raises(ValueError, match="first_backoff_s <= max_backoff_s"):
        Retry(first_backoff_s=2.0, max_backoff_s=1.0)
