"""Rotary position embeddings (RoPE) in the rotate-half convention of HF Llama.

    table(head_dim, theta, positions) -> cos, sin          [positions, D] fp32 each, computed on the CPU
      cos[p] = cos(p * f), sin[p] = sin(p * f), f = theta ** (-2i / D) for i < D/2, repeated for the second half

    rotate(x, cos, sin) -> y                               x: [T, H, D]; cos, sin: [T, D]
      y = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin                                      -> y: [T, H, D]

``rotate`` has no reduction, so no order to choose: each element is two products and a sum, each rounded on its own.
Out of autograd, fp32 on the CPU, it is one call of Lathe's C library (``chain.c``'s ``lathe_rope``, built with
``-ffp-contract=off`` so nothing fuses those roundings) instead of six ATen ops: the same bits, 14 us for a decode
row where the ops took 56 (AVX2 EPYC). Under autograd, or where the library does not build, torch's ops run.

Who owns what: the decoder (``lathe.models.decoder``) owns the table on its device and the rows' positions; this
module only computes.
"""

from __future__ import annotations

import torch

from lathe.kernels import chain


def table(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[positions, head_dim]`` (fp32, on the CPU, so every device gets the same bits)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, H, D]`` with ``cos, sin [T, D]`` (in x's dtype): in the C library where it may run, the same
    bits as torch's ops."""
    if x.dtype == torch.float32 and x.is_cpu and not (torch.is_grad_enabled() and x.requires_grad) \
            and chain.available():
        return rotate_in_library(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def rotate_in_library(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotate`` in one call of the C library: x [T, H, D] (each head's elements contiguous), cos and sin [T, D]
    contiguous, all fp32 on the CPU -> y [T, H, D]; refused, saying what was wrong, otherwise."""
    lib = chain.library()
    for name, u, dims in (("x", x, 3), ("cos", cos, 2), ("sin", sin, 2)):
        if u.dtype != torch.float32 or not u.is_cpu or u.dim() != dims:
            raise TypeError(f"rotary takes {dims}-d fp32 CPU tensors as {name}, got {u.dtype} {list(u.shape)} on "
                            f"{u.device}")
    x = x if x.stride()[2] == 1 else x.contiguous()
    t, h, d = x.shape
    if d % 2 or cos.shape != (t, d) or sin.shape != (t, d) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rotary: x {list(x.shape)} needs an even D and contiguous cos, sin [{t}, {d}], got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    y = torch.empty(t, h, d, dtype=torch.float32)
    xs = x.stride()
    lib.lathe_rope(x.data_ptr(), xs[0], xs[1], cos.data_ptr(), sin.data_ptr(), y.data_ptr(), t, h, d)
    return y
