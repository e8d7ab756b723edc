"""The invariance tests again under the kernel libraries' AVX2 code paths, in a child process.

Kernel libraries pick their code path by the CPU's instruction set: MKL and ATen run AVX-512 kernels
where the CPU has them, and the bits of a matmul's rows switch at other shapes on each path. One machine
checks both paths: this test reruns the op invariance tests and the exactness self-check with
``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` (on an AVX2-only CPU they are the paths
already taken, and the rerun repeats the check).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AVX2_PATH = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def test_invariance_holds_on_the_avx2_code_paths() -> None:
    env = {**os.environ, **AVX2_PATH}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True, timeout=120)
    assert probe.stdout.strip() in {"AVX2", "DEFAULT"}, f"ATen did not take the AVX2 path: {probe.stdout!r}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ops_invariance.py",
         "tests/test_exactness.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, f"under {AVX2_PATH}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and "failed" not in run.stdout
