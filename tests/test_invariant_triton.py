"""The batch-invariant Triton matmul (the GPU path of lathe.kernels.ops): interpreted checks in a child
process (Triton reads TRITON_INTERPRET when a kernel is first defined), and compilation for sm_90."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lathe.kernels import invariant_triton

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.processes
def test_kernel_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(REPO / "tests" / "invariant_interpreted.py")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and "skipped" not in summary, run.stdout + run.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernel_compiles_for_sm90(dtype: str) -> None:
    triton = pytest.importorskip("triton")
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = invariant_triton._kernel().bmm
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    bm, bn, bk = invariant_triton.BLOCKS.get(torch_dtype, invariant_triton.DEFAULT_BLOCKS)
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IEEE": dtype == "fp32"}
    signature = {name: "constexpr" if name in constexprs else f"*{dtype}" if name.endswith("_ptr") else "i64"
                 for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
