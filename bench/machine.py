"""What machine a figure was measured on: ``lscpu``'s model name and the SIMD flags that pick kernel code paths.

Imported by the ``bench/*.py`` scripts (run as ``python bench/<script>.py``, so this directory is on the path).
"""

from __future__ import annotations

import os
import subprocess

FLAG_PREFIXES = ("avx", "amx", "sha", "f16c", "fma")


def cpu_line() -> str:
    """e.g. ``AMD EPYC (2 cores; flags avx avx2 f16c fma sha_ni)``."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(FLAG_PREFIXES)]
    return f"{fields.get('Model name', '?').strip()} ({os.cpu_count()} cores; flags {' '.join(flags)})"
