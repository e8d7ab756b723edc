"""Grade clamp completions by running them in a sandboxed subprocess.

In: a completion (text after the prefill) or a function source. Out: a ``GradeResult`` per source.
State: one temp dir per run (the child's empty cwd, plus the report file the child writes through
its stdout), deleted when the run ends. Candidate code never runs in this process.

The sandbox, in layers (what each stops and what none stops: ``SANDBOX.md``):

- a fresh process, ``python -I -S -B`` (no ``PYTHON*`` variables, no user or script dir on ``sys.path``, no
  ``site``, no bytecode writes) with an empty environment, so it inherits no secret, in a fresh empty working
  directory, in its own session so a timeout kills the whole process group;
- its own network namespace (``unshare --net``, with ``--user`` when not root) wherever ``unshare`` works:
  no interface but a downed loopback, so nothing is reachable even past the audit hook;
- hard resource limits set by the child before the candidate runs (address space, CPU seconds, file size,
  open files, no new processes, no core dumps), and, when it runs as root, the child becomes ``nobody``,
  which cannot raise them again, read root's files or the grader's ``/proc/<pid>/environ``;
- an audit hook with an allow-list of events (``_sandbox_child.ALLOWED_EVENTS``) that the candidate has no
  reference to: any other event (opening any file, importing a module not preloaded, sockets, processes,
  signals, frames and code objects, ctypes, gc, limits) ends the run with ``blocked: <event>``.

The limits are set by the child itself, not in ``preexec_fn``: ``grade_many`` spawns from threads,
where ``preexec_fn`` may deadlock, and a limit lowered before the candidate runs binds it the same.

The parent trusts only the report line carrying its per-run nonce, checks its shape, and compares
the returned values against the expected ones itself (the child never sees them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from examples.clamp.task import END_OF_TURN, FIXTURES

CHILD = Path(__file__).with_name("_sandbox_child.py")
END_MARKERS = ("```", END_OF_TURN)
REPORT_BYTES = 1 << 20
OPEN_FILES = 16  # the child holds 4 descriptors; the candidate can open none (the hook refuses every open)


@dataclass(frozen=True, slots=True)
class GradeResult:
    """How one source did on the fixtures.

    ``error`` is None when every fixture returned a number (right or wrong); otherwise it names what
    ended the run (then ``passed`` is 0) or the first fixture that raised or returned a non-number.
    """

    passed: int
    total: int = len(FIXTURES)
    error: str | None = None

    @property
    def reward(self) -> float:
        """1.0 when every fixture passed, else 0.0."""
        return float(self.passed == self.total)

    @property
    def fraction(self) -> float:
        """The share of fixtures passed, a denser reward beside ``reward``."""
        return self.passed / self.total


def extract_function(completion_text: str, prefill: str) -> str:
    """Rebuild the candidate source: the code part of the prefill plus the completion up to its end.

    The code part of the prefill is what follows the opening fence line (all of it if there is no
    fence). The completion ends at its closing fence or end-of-turn token, whichever comes first,
    or at the end of the text; anything after that (chatter) is dropped.
    """
    _, fence, after = prefill.partition("```")
    code = after.partition("\n")[2] if fence else prefill
    end = min((i for i in (completion_text.find(m) for m in END_MARKERS) if i >= 0), default=len(completion_text))
    return code + completion_text[:end]


def grade(source: str, *, timeout_s: float = 2.0, memory_mb: int = 256) -> GradeResult:
    """Run ``source`` against the fixtures in a sandboxed child and grade what it reports.

    ``timeout_s`` bounds the child's wall-clock time (start-up included) and, rounded up, its CPU
    time; ``memory_mb`` bounds its address space. Whatever the candidate does, the answer is a result
    (0 reward on any failure), not an exception; only failing to start the child raises.
    """
    nonce = secrets.token_hex(16)
    request = json.dumps({
        "nonce": nonce,
        "source": source,
        "args": [[x, lo, hi] for x, lo, hi, _ in FIXTURES],
        "limits": {"memory_bytes": memory_mb << 20, "cpu_s": math.ceil(timeout_s), "file_bytes": REPORT_BYTES,
                   "open_files": OPEN_FILES},
    }).encode()
    with tempfile.TemporaryDirectory(prefix="clamp-grade-", ignore_cleanup_errors=True) as root:
        workdir, report_path = Path(root, "work"), Path(root, "report")
        workdir.mkdir()
        with report_path.open("wb") as report_file:
            proc = subprocess.Popen(
                [*network_namespace(), sys.executable, "-I", "-S", "-B", str(CHILD)], cwd=workdir, env={},
                stdin=subprocess.PIPE, stdout=report_file, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            proc.communicate(request, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return GradeResult(0, error="timeout")
        return _parse_report(report_path.read_bytes()[:REPORT_BYTES], nonce, proc.returncode)


@functools.cache
def network_namespace() -> tuple[str, ...]:
    """The command prefix that starts a child in a new, empty network namespace, or () where ``unshare``
    is missing or not permitted (then only the audit hook keeps the candidate off the network)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net") if os.geteuid() == 0 else (unshare, "--user", "--net")
    try:
        probe = subprocess.run([*prefix, "true"], env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return prefix if probe.returncode == 0 else ()


def _parse_report(data: bytes, nonce: str, returncode: int) -> GradeResult:
    """The result from the one report line with our nonce; anything else in the file is ignored."""
    reports = []
    for line in data.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("nonce") == nonce:
            reports.append(obj)
    if len(reports) != 1:
        if returncode == -signal.SIGXCPU:
            return GradeResult(0, error="timeout")
        return GradeResult(0, error=f"no result (exit code {returncode})")
    error, outcomes = reports[0].get("error"), reports[0].get("outcomes")
    if isinstance(error, str) and outcomes == []:
        return GradeResult(0, error=error[:100])
    if error is not None or not isinstance(outcomes, list) or len(outcomes) != len(FIXTURES) or not all(
            isinstance(o, dict) for o in outcomes):
        return GradeResult(0, error="malformed result")
    passed = sum(type(o.get("value")) in (int, float) and o["value"] == fixture[3]
                 for o, fixture in zip(outcomes, FIXTURES, strict=True))
    raised = [o["error"] for o in outcomes if isinstance(o.get("error"), str)]
    return GradeResult(passed, error=raised[0][:100] if raised else None)


def grade_many(sources: Sequence[str], max_workers: int = 2, *, timeout_s: float = 2.0,
               memory_mb: int = 256) -> list[GradeResult]:
    """``grade`` each source, ``max_workers`` children at a time, results in input order."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda s: grade(s, timeout_s=timeout_s, memory_mb=memory_mb), sources))


def center(rewards: Sequence[float]) -> tuple[float, ...]:
    """Rewards minus their mean (group-relative advantages); empty or non-finite input is an error."""
    if not rewards or not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be nonempty and finite, got {tuple(rewards)!r}")
    mean = sum(rewards) / len(rewards)
    return tuple(r - mean for r in rewards)


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ at all (a group of equal rewards teaches nothing)."""
    return len(set(rewards)) > 1
