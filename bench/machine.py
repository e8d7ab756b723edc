"""What machine a figure was measured on: ``lscpu``'s model name and the SIMD flags that pick kernel code paths.

Imported by the ``bench/*.py`` scripts (run as ``python bench/<script>.py``, so this directory is on the path).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

FLAG_PREFIXES = ("avx", "amx", "sha", "f16c", "fma")


def cpu_line() -> str:
    """e.g. ``AMD EPYC (2 cores; flags avx avx2 f16c fma sha_ni)``."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(FLAG_PREFIXES)]
    return f"{fields.get('Model name', '?').strip()} ({os.cpu_count()} cores; flags {' '.join(flags)})"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gemm_gflops(threads: int, rows: int = 256, k: int = 576, n: int = 1536, repeats: int = 300,
                dtype: str = "float32") -> float:
    """GEMM throughput of this machine at ``threads`` torch threads ([rows, k] @ [k, n] in ``dtype``, best of
    ``repeats``, a few tenths of a second, so a shared VM's slow moment does not set it): the arithmetic rate a
    figure's floor is computed with."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = torch.randn(rows, k, dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype))
        for _ in range(3):
            x @ w
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x @ w
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return 2 * rows * k * n / best / 1e9


def read_gbps(mbytes: int = 512, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in GB/s: the best of ``repeats`` sums over an fp32 tensor of ``mbytes``
    MB (more than a cache holds), the rate a decode figure's floor is computed with."""
    import time

    import torch

    x = torch.ones(mbytes * 2**18)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9
