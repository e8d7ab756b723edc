"""The Triton BGMV kernels under Triton's interpreter, against the torch reference BGMV.

Run by ``tests/test_slot_pool.py::test_triton_bgmv_matches_the_torch_reference_interpreted`` in a child
pytest process with TRITON_INTERPRET=1 (set before the kernels are first defined). fp32 only (the
interpreter gets bf16 dots wrong).
"""

from __future__ import annotations

import os

import torch

from lathe.kernels import lora
from lathe.kernels import sgmv_triton as st

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module with TRITON_INTERPRET=1 (tests/test_slot_pool.py does)")


def test_bgmv_kernels_equal_the_torch_reference() -> None:
    assert st.triton_available()
    T, H, out, R, N = 19, 72, 40, 16, 5
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=gen)
    A = torch.randn(N, R, H, generator=gen) / H**0.5
    B = torch.randn(N, out, R, generator=gen) / R**0.5
    scale = torch.rand(N, generator=gen) + 0.5
    idx = torch.randint(-1, N, (T,), generator=gen)
    idx[[0, 5]] = -1
    want_v = lora.bgmv_shrink(x, A, idx)
    v = st.bgmv_shrink(x, A, idx, out=torch.full((T, R), float("nan")))
    torch.testing.assert_close(v, want_v, rtol=1e-5, atol=1e-5)
    want_y = lora.bgmv_expand(want_v, B, idx, scale)
    y = st.bgmv_expand(want_v, B, idx, scale, torch.full((T, out), float("nan")), add=False)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    assert not y[idx < 0].any()
