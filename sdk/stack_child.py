"""``Service``: one child process of the embedded stack (``lathe.stack.Stack``) and what it printed.

Owns a child's flags, its ports, its current process, the lines it printed and the addresses its ready lines
named; ``start`` runs ``python -m lathe.<name>`` with them and ``await_ready`` pins the ports the process bound,
so that a restart serves the same address. When to start, restart or stop a child is the ``Stack``'s.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lathe.runtime.probes import METRICS_MARK
from lathe.runtime.serving import READY_MARK

READY_TIMEOUT_S = 180.0


@dataclass(slots=True)
class Service:
    """One child of the stack: the flags it runs with, its current process and what that process printed.

    ``ports`` maps each port flag (``--port``, the gateway's ``--http-port``, ``--metrics-port``) to its port: 0
    (any free port) until the first process binds one, then the bound port, so that a restart serves the same
    address.
    """

    name: str
    args: list[str]
    ports: dict[str, int]
    proc: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)  # port flag -> HOST:PORT from the ready lines
    restarts: list[float] = field(default_factory=list)  # monotonic times of the supervisor's restarts

    @property
    def address(self) -> str:
        return self.addresses.get("--port", "")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def stop_turn(self) -> int:
        """When ``Stack.stop`` stops this child: the gateways first, then the pools, then the checkpoints service."""
        return 0 if self.name == "gateway" else 2 if self.name == "checkpoints" else 1

    def start(self, host: str, env: dict[str, str], log_dir: Path | None) -> threading.Event:
        """Start the process (its stderr appended to ``log_dir``/<name>.log when given) and the thread that reads
        its output; the event its ready line sets."""
        cmd = [sys.executable, "-m", f"lathe.{self.name}", "--host", host, *self.args]
        for flag, port in self.ports.items():
            cmd += [flag, str(port)]
        if log_dir is None:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        else:
            log_dir.mkdir(parents=True, exist_ok=True)
            with open(log_dir / f"{self.name}.log", "ab") as log:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env)
        lines: list[str] = []
        addresses: dict[str, str] = {}
        self.proc, self.lines, self.addresses = proc, lines, addresses
        ready = threading.Event()
        name = self.name
        flags = {f"lathe.{name}": "--port", f"lathe.{name} http": "--http-port"}

        def drain() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                head, metrics_mark, url = line.partition(METRICS_MARK)
                if metrics_mark and head == f"lathe.{name}":
                    addresses["--metrics-port"] = url.strip().removeprefix("http://").removesuffix("/metrics")
                head, mark, address = line.partition(READY_MARK)
                if mark and head in flags and not ready.is_set():
                    addresses[flags[head]] = address.strip()
                    if flags[head] == "--port":
                        ready.set()

        threading.Thread(target=drain, name=f"{name}-stdout", daemon=True).start()
        return ready

    def await_ready(self, ready: threading.Event) -> None:
        """Wait (bounded) for the ready line; pin the ports the process bound."""
        proc, addresses = self.proc, self.addresses
        assert proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.05):
            if proc.poll() is not None:
                raise RuntimeError(f"lathe.{self.name} exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"lathe.{self.name} was not ready within {READY_TIMEOUT_S:.0f} s")
        for flag, address in addresses.items():
            self.ports[flag] = int(address.rpartition(":")[2])
