"""Sandbox child: run one untrusted candidate against the fixture arguments and report once.

Started by ``grader.grade`` as ``python -I -S -B _sandbox_child.py`` (inside its own network namespace where
``unshare`` works) in a fresh empty temp dir with an empty environment. Reads one JSON request from stdin::

    {"nonce": str, "source": str, "args": [[x, lo, hi], ...],
     "limits": {"memory_bytes": int, "cpu_s": int, "file_bytes": int, "open_files": int}}

and writes exactly one JSON line ``{"nonce", "error", "outcomes"}`` to the file the parent passed as
stdout, where ``outcomes[i]`` is ``{"value": number}`` or ``{"error": str}`` for ``args[i]`` (empty
when ``error`` ends the run). The candidate's stdout and stderr go to /dev/null, so its prints
cannot mix with the report.

Order: import the modules candidates may use (``ALLOWED_MODULES``), read the request, lower the resource
limits (soft and hard), give up root (to ``nobody``) if the child has it, move the report channel off fd 1,
compile, install the guard, run the candidate. The guard is an audit hook with an allow-list: any event outside
``ALLOWED_EVENTS`` ends the process at once with a ``blocked: <event>`` report, so candidate code cannot catch
it and carry on. Outside the list are, among others, every file open (reads included), directory listing,
import of a module not already loaded, socket, process and signal events, ctypes, gc heap walks, changing
limits, and every way to a frame or a function's code (``sys._getframe``, tracebacks' and generators' frames,
tracing and profiling hooks, reading or replacing ``__code__``). The hook lives in a closure that only the
interpreter holds, and its allow-list is a frozenset in that closure: without frames, code objects or gc, the
candidate has no reference to either, so it can neither rewrite the list nor switch the hook off. Rebinding
this script's globals or the builtins can at most break the rest of this script, which costs only its reward.
"""

import cmath  # noqa: F401 - ALLOWED_MODULES: loaded before the guard, so candidates may import them
import collections  # noqa: F401
import functools  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import numbers  # noqa: F401
import operator  # noqa: F401
import os
import resource
import sys
import typing  # noqa: F401
from collections.abc import Callable
from typing import NoReturn

ALLOWED_MODULES = ("cmath", "collections", "functools", "itertools", "math", "numbers", "operator", "typing")
# What plain computation raises: running and compiling code (exec/eval), id(), time.sleep.
ALLOWED_EVENTS = frozenset({"exec", "compile", "builtins.id", "time.sleep"})
NOBODY = 65534
BLOCKED_EXIT = 3  # the exit code when even the report of a block failed

Reporter = Callable[[str | None, list[dict]], NoReturn]
_INT64 = 1 << 63


def make_reporter(report_fd: int, nonce: str) -> Reporter:
    """The one way out: write the report line to ``report_fd``, then end the process at once."""
    dumps, write, exit_now = json.dumps, os.write, os._exit

    def report(error: str | None, outcomes: list[dict]) -> NoReturn:
        write(report_fd, (dumps({"nonce": nonce, "error": error, "outcomes": outcomes}) + "\n").encode())
        exit_now(0)

    return report


def install_guard(report: Reporter) -> None:
    """Add the audit hook that ends the run on any event outside ``ALLOWED_EVENTS``."""
    allowed, exit_now = ALLOWED_EVENTS, os._exit

    def hook(event: str, args: tuple) -> None:
        if event in allowed:
            return
        try:
            report(f"blocked: {event}", [])
        finally:
            exit_now(BLOCKED_EXIT)  # reached only if a candidate broke the reporter

    sys.addaudithook(hook)


def lower_limits(limits: dict) -> None:
    """Hard resource limits, then no root: ``nobody`` cannot raise them again, read root's files or another
    user's ``/proc/<pid>/environ``, and ``RLIMIT_NPROC`` binds it (it does not bind root)."""
    for which, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, limits["cpu_s"]),
                         (resource.RLIMIT_FSIZE, limits["file_bytes"]), (resource.RLIMIT_NOFILE, limits["open_files"]),
                         (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def outcome(value: object) -> dict:
    """One fixture's outcome: a plain int or float is reported as is, anything else as an error."""
    if type(value) is int and not -_INT64 <= value < _INT64:
        return {"error": "returned an int beyond 64 bits"}
    if type(value) in (int, float):
        return {"value": value}
    return {"error": f"returned {type(value).__name__}"}


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    lower_limits(request["limits"])
    report_fd = os.dup(1)
    null_fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null_fd, 1)
    os.dup2(null_fd, 2)
    os.close(null_fd)
    report = make_reporter(report_fd, request["nonce"])
    try:
        code = compile(request["source"], "<candidate>", "exec")
    except (SyntaxError, ValueError):  # ValueError: null bytes in the source
        report("syntax error", [])
    install_guard(report)
    namespace: dict = {"__name__": "__candidate__"}
    try:
        exec(code, namespace)
    except MemoryError:
        report("memory limit", [])
    except BaseException as e:  # noqa: BLE001 - any failure of untrusted code, SystemExit included, is a verdict
        report(f"raised {type(e).__name__}", [])
    clamp = namespace.get("clamp")
    if not callable(clamp):
        report("no function named clamp", [])
    outcomes = []
    for x, lo, hi in request["args"]:
        try:
            outcomes.append(outcome(clamp(x, lo, hi)))
        except MemoryError:
            report("memory limit", [])
        except BaseException as e:  # noqa: BLE001 - as above, per call
            outcomes.append({"error": f"raised {type(e).__name__}"})
    report(None, outcomes)


main()
