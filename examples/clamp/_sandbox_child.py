"""Sandbox child: run one untrusted candidate against the fixture arguments and report once.

Started by ``grader.grade`` as ``python -I -S -B _sandbox_child.py`` in a fresh empty temp dir with
an empty environment. Reads one JSON request from stdin::

    {"nonce": str, "source": str, "args": [[x, lo, hi], ...],
     "limits": {"memory_bytes": int, "cpu_s": int, "file_bytes": int}}

and writes exactly one JSON line ``{"nonce", "error", "outcomes"}`` to the file the parent passed as
stdout, where ``outcomes[i]`` is ``{"value": number}`` or ``{"error": str}`` for ``args[i]`` (empty
when ``error`` ends the run). The candidate's stdout and stderr go to /dev/null, so its prints
cannot mix with the report.

Order: read the request, lower the resource limits (soft and hard), move the report channel off
fd 1, compile, install the audit hook, run the candidate. From then on a forbidden operation ends
the process at once with a ``blocked: ...`` report, so candidate code cannot catch it and carry on.
The hook and the reporter are closures built in their own frames that use no module global or
builtin, so a candidate that rebinds those cannot switch the hook off; it can at most break the
rest of this script, which only costs it its own reward.
"""

import json
import os
import resource
import sys
from collections.abc import Callable
from typing import NoReturn

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
    """Add the audit hook that ends the run on network, process, file-write, ctypes, gc or limit events.

    Every open for writing is blocked, not only those outside the temp dir: ``os.open(path,
    flags, dir_fd=fd)`` reports ``path`` without ``fd``, so "inside" cannot be decided from the event.
    """
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    prefixes = (("socket.", "blocked: network"), ("ctypes.", "blocked: ctypes"))
    blocked = {
        **dict.fromkeys(("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                         "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill"),
                        "blocked: process"),
        **dict.fromkeys(("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.link", "os.symlink",
                         "os.truncate", "os.chmod", "os.chown", "os.utime", "os.chflags", "os.setxattr",
                         "os.removexattr", "shutil.rmtree"), "blocked: file write"),
        # Walking the heap would reach this hook's closure.
        **dict.fromkeys(("gc.get_objects", "gc.get_referrers", "gc.get_referents"), "blocked: introspection"),
        # Root can raise even hard limits again.
        **dict.fromkeys(("resource.setrlimit", "resource.prlimit"), "blocked: limits"),
    }

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args[2] & write_flags:  # args: (path, mode, flags)
            report("blocked: file write", [])
        for prefix, reason in prefixes:
            if event.startswith(prefix):
                report(reason, [])
        reason = blocked.get(event)
        if reason is not None:
            report(reason, [])

    sys.addaudithook(hook)


def outcome(value: object) -> dict:
    """One fixture's outcome: a plain int or float is reported as is, anything else as an error."""
    if type(value) is int and not -_INT64 <= value < _INT64:
        return {"error": "returned an int beyond 64 bits"}
    if type(value) in (int, float):
        return {"value": value}
    return {"error": f"returned {type(value).__name__}"}


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    limits = request["limits"]
    for which, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, limits["cpu_s"]),
                         (resource.RLIMIT_FSIZE, limits["file_bytes"]), (resource.RLIMIT_NPROC, 0),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))
    report_fd = os.dup(1)
    null_fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null_fd, 1)
    os.dup2(null_fd, 2)
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
    except BaseException as e:  # any failure of untrusted code, SystemExit included, is a verdict
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
        except BaseException as e:
            outcomes.append({"error": f"raised {type(e).__name__}"})
    report(None, outcomes)


main()
