"""lathe.kernels.rotary: RoPE's rotation in one call of Lathe's C library has the bits of torch's elementwise ops (it
has no reduction, so nothing to choose), under the decoder's autograd path and out of it; bad operands are refused
saying what was wrong; without a C compiler torch's ops run."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels import chain, rotary


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the decoder's autograd path computes it (torch's elementwise ops)."""
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None, :]


@pytest.mark.parametrize("shape", [(1, 9, 64), (7, 3, 64), (33, 4, 128), (5, 2, 6)])
def test_rope_in_one_call_has_the_bits_of_torchs_elementwise_ops(gen: torch.Generator, shape: tuple[int, ...]) -> None:
    t, h, d = shape
    x = torch.randn(t, h, d, generator=gen) * torch.logspace(-30, 30, d)  # products that round, and some that underflow
    x[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40])
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    want = _torch_rope(x, cos, sin)
    assert torch.equal(rotary.rotate_in_library(x, cos, sin).view(torch.int32), want.view(torch.int32))
    strided = torch.randn(t, 2 * h, d, generator=gen)[:, ::2]  # heads of a wider projection
    assert torch.equal(rotary.rotate_in_library(strided, cos, sin).view(torch.int32),
                       _torch_rope(strided, cos, sin).view(torch.int32))
    # the decoder's rotation: through the kernel out of autograd, torch's ops under it, the same bits
    with torch.no_grad():
        inference = rotary.rotate(x, cos, sin)
    trained = rotary.rotate(x.clone().requires_grad_(), cos, sin)
    assert trained.grad_fn is not None
    assert torch.equal(inference.view(torch.int32), trained.detach().view(torch.int32))


def test_bad_rope_operands_are_refused_with_what_was_wrong() -> None:
    with pytest.raises(TypeError, match=r"rotary takes 3-d fp32 CPU tensors as x, got torch.bfloat16 \[1, 2, 4\]"):
        rotary.rotate_in_library(torch.ones(1, 2, 4, dtype=torch.bfloat16), torch.ones(1, 4), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"x \[1, 2, 5\] needs an even D"):
        rotary.rotate_in_library(torch.ones(1, 2, 5), torch.ones(1, 5), torch.ones(1, 5))
    with pytest.raises(ValueError, match=r"contiguous cos, sin \[2, 4\], got \[1, 4\]"):
        rotary.rotate_in_library(torch.ones(2, 2, 4), torch.ones(1, 4), torch.ones(2, 4))


def test_without_a_compiler_the_rotation_keeps_torchs_ops(no_compiler: None, gen: torch.Generator) -> None:
    assert not chain.available()
    x, cos, sin = (torch.randn(*shape, generator=gen) for shape in ((3, 2, 8), (3, 8), (3, 8)))
    with torch.no_grad():
        assert torch.equal(rotary.rotate(x, cos, sin), _torch_rope(x, cos, sin))
    with pytest.raises(RuntimeError, match="not available on this machine"):
        rotary.rotate_in_library(x, cos, sin)
