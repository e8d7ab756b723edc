"""The invariance tests again under other code paths of the kernel libraries, each in a child process.

Kernel libraries pick their code path by the CPU's instruction set: MKL and ATen run AVX-512 kernels
where the CPU has them, and the bits of a matmul's rows switch at other shapes on each path. One machine
checks several paths: these tests rerun the op invariance tests and the exactness self-check
- with ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2``, where the CPU has more than AVX2 (on an
  AVX2-only CPU they are the paths the whole suite already takes: no rerun there, 30 s saved on the slowest kind);
- with ``ATEN_CPU_CAPABILITY=default``: ATen's portable kernels, which every x86 CPU runs and which give
  an fp32 matmul other bits than its AVX2 ones (measured), so the tile choice is proven on a path it was
  never tuned on. The exactness tests' bf16 cases (the ids ``[bf16]``) are left out there: no machine runs a bf16
  pool on this path (bf16 is the default only where the CPU has native bf16, whose kernels are AVX-512's), and
  their scalar bf16 products took 17 of the rerun's 39 s on an AVX2 EPYC. The op tests keep both dtypes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PATHS = {
    "avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, {"AVX2", "DEFAULT"}, ()),
    "default": ({"ATEN_CPU_CAPABILITY": "default"}, {"DEFAULT"}, ("-k", "not bf16")),
}
"""Each path: the environment that selects it, the capabilities ATen may report under it, and the tests it
leaves out (pytest arguments)."""
OTHER_PATHS = sorted(p for p in PATHS if p.upper() != torch.backends.cpu.get_cpu_capability())
"""The paths this CPU does not take on its own."""


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_invariance_holds_on_other_code_paths(path: str) -> None:
    overrides, capabilities, selection = PATHS[path]
    env = {**os.environ, **overrides}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True, timeout=120)
    assert probe.stdout.strip() in capabilities, f"ATen did not take the {path} path: {probe.stdout!r}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ops_invariance.py",
         "tests/test_exactness.py", *selection],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, f"under {overrides}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and "failed" not in run.stdout
