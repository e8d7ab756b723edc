"""The SGMV/BGMV Triton kernels (lathe.kernels.sgmv_triton) against the torch reference (lathe.kernels.lora).

Triton reads TRITON_INTERPRET when the kernels are first defined, so the kernel checks
(``tests/sgmv_interpreted.py``, not collected on its own) run in a child pytest process that has the
variable set. This process also checks that importing the module needs
no Triton and that the kernels compile for sm_90 (H100/H200): the interpreter runs code that the
compiler would reject. Interpreted dots use fp32 and fp16 only (the interpreter gets bf16 dots wrong).
References are computed in float64; every kernel writes into a NaN-filled buffer so a row or slot it
fails to write shows up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lathe.kernels import sgmm_triton

REPO = Path(__file__).resolve().parent.parent


# --- parent process ----------------------------------------------------------------------------


@pytest.mark.processes
def test_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "sgmv_interpreted.py")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and "skipped" not in summary, run.stdout + run.stderr


@pytest.mark.processes
def test_import_needs_no_triton() -> None:
    code = "import sys, lathe.kernels.sgmv_triton; assert 'triton' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


_TILES = {"BLOCK_T": 32, "BLOCK_M": 32, "BLOCK_K": 128}  # rank 32, hidden 4096


@pytest.mark.parametrize(
    ("kernel", "dtype", "constexprs"),
    [
        ("sgmm", "bf16", {"HAS_SCALE": True, "ADD": True, "PRECISION": "tf32", **_TILES}),
        ("sgmm", "fp32", {"HAS_SCALE": False, "ADD": False, "PRECISION": "ieee", **_TILES}),
        ("seg_outer", "bf16", {"HAS_ALPHA": True, "PRECISION": "tf32", **_TILES}),
        ("bgmm", "bf16", {"HAS_SCALE": True, "ADD": True, "BLOCK_M": 32, "BLOCK_K": 128}),
        ("bgmm", "fp16", {"HAS_SCALE": False, "ADD": False, "BLOCK_M": 128, "BLOCK_K": 32}),
    ],
)
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernel_compiles_for_sm90(kernel: str, dtype: str, constexprs: dict[str, object]) -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(sgmm_triton._kernels(), kernel)
    pointers = dict.fromkeys(["x", "w", "out", "p", "q", "g"], dtype)
    pointers |= {"scale": "fp32", "alpha": "fp32", "seg": "i64", "ids": "i64", "idx": "i64"}
    signature = {
        name: "constexpr" if name in constexprs else f"*{pointers[name]}" if name in pointers else "i64"
        for name in fn.arg_names
    }
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    )
    assert compiled.asm["cubin"]
