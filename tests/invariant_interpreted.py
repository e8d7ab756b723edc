"""The invariant batched matmul (lathe.kernels.invariant_triton) under TRITON_INTERPRET=1, and the invariant
ops and self-check with every product routed through it (what a CUDA pool runs). Run by
tests/test_invariant_triton.py in a child process; not collected on its own (no ``test_`` prefix)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module with TRITON_INTERPRET=1 (tests/test_invariant_triton.py does)")

from lathe.kernels import ops, tiling
from lathe.kernels.invariant_triton import invariant_bmm
from lathe.models import checks
from lathe.models.decoder import Decoder
from lathe.models.tiny import ensure_tiny_model


@pytest.mark.parametrize(("m", "k", "n"), [(1, 40, 70), (67, 96, 33), (130, 64, 65)])
def test_values_match_float64_with_a_shared_operand(m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(3, m, k, generator=gen)
    w = torch.randn(k, n, generator=gen)
    out = invariant_bmm(a, w.expand(3, k, n))  # stride-0 batch: one weight for every item
    torch.testing.assert_close(out.double(), a.double() @ w.double(), rtol=1e-5, atol=1e-5)


def test_every_row_and_column_is_written_at_any_shape() -> None:
    """Rows and columns past whole tiles are masked, not dropped: a NaN-free result equal to the reference.

    (Bit invariance itself is the GPU's property, checked by bench/gpu_check.py: the interpreter's dots are
    numpy matmuls, whose bits follow the host BLAS.)"""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(150, 96, generator=gen), torch.randn(96, 80, generator=gen)
    for rows in ((0, 1), (63, 65), (3, 20), (60, 130), (149, 150)):
        part = invariant_bmm(x[None, rows[0] : rows[1]], w[None])[0]
        assert part.shape == (rows[1] - rows[0], 80) and not part.isnan().any()
        torch.testing.assert_close(part, x[rows[0] : rows[1]] @ w, rtol=1e-5, atol=1e-4)


def test_gradients_flow_to_both_operands() -> None:
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    b = torch.randn(16, 7, generator=gen, requires_grad=True)
    invariant_bmm(a, b.expand(2, 16, 7)).sum().backward()
    a2, b2 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (a2 @ b2).sum().backward()
    torch.testing.assert_close(a.grad.double(), a2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), b2.grad, rtol=1e-5, atol=1e-5)


def test_decoder_on_the_kernel_path_agrees_with_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA pool runs (ops route every product to the kernel on CUDA tensors), here on CPU tensors:
    the tiny decoder's packed logprobs through the kernel equal the CPU ops' to fp32 rounding."""
    cache = Path(os.environ.get("LATHE_CACHE", Path(__file__).resolve().parents[1] / ".cache" / "lathe"))
    model = Decoder.from_dir(ensure_tiny_model(cache, "llama"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        want = checks.packed_logprobs(model, gen, 4)[2]
        monkeypatch.setattr(ops, "_bmm", invariant_bmm)
        monkeypatch.setattr(ops, "tiled_matmul", lambda x, w, tile=tiling.ROW_TILE: invariant_bmm(x[None], w[None])[0])
        got = checks.packed_logprobs(model, torch.Generator().manual_seed(3), 4)[2]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
