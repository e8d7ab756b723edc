"""Test helpers for the S3 backend: a live SeaweedFS (``LocalS3``) and a checkpoints server process over it.

Both are started and stopped by the tests themselves, on loopback, with bounded waits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from lathe.checkpoints.seaweed import LocalS3
from tests.test_checkpoints_process import READY_TIMEOUT_S, wait_for_line


@contextlib.contextmanager
def checkpoints_process(s3: LocalS3, env: dict[str, str] | None = None, prefix: str = "ckpt"
                        ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m lathe.checkpoints --root s3://<bucket>/<prefix>`` with ``s3``'s credentials (or ``env``):
    yields the process and its ``host:port``; SIGKILLed on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lathe.checkpoints", "--port", "0", "--host", "127.0.0.1",
         "--root", f"{s3.url}/{prefix}", "--sweep-interval", "3600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or s3.env()), "PYTHONUNBUFFERED": "1"})
    try:
        line = wait_for_line(proc, READY_TIMEOUT_S)
        yield proc, line.rsplit(" ", 1)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
