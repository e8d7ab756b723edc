"""A batch-invariant batched matmul in Triton: the GPU path of the invariant ops' products.

    invariant_bmm(a, b) -> c
      a: [B, M, K]; b: [B, K, N] (any strides; a stride-0 batch dim is a shared operand, never copied)
      c[i] = a[i] @ b[i], accumulated in fp32, returned in a's dtype                     -> c: [B, M, N]

Why a kernel of our own on GPU: cuBLAS picks its algorithm (tile shape, split-K) by problem size and
batch count, so a row's bits change with the batch, exactly as MKL's do on CPU. Here every program
computes one ``[BLOCK_M, BLOCK_N]`` tile of one batch item with a fixed ``BLOCK_K`` loop over K in
order, with fixed tile sizes per dtype and no split-K: an output element's reduction order depends on
K alone, never on M, N, B or the element's position, so row i of c has the same bits whatever else is
in the batch. fp32 dots use IEEE precision (no TF32). No atomics: bitwise reproducible.

Backward passes (through ``InvariantBmm``) are plain ``torch.matmul``: only forwards need invariance.
Triton is imported on first use; ``lathe.kernels.ops`` calls this for CUDA tensors only, and the tests
run it under ``TRITON_INTERPRET=1`` on CPU (fp32: the interpreter gets bf16 dots wrong).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

BLOCKS = {torch.float32: (64, 64, 32), torch.float64: (32, 32, 16)}
"""(BLOCK_M, BLOCK_N, BLOCK_K) per input dtype; every other dtype (bf16, fp16) uses ``DEFAULT_BLOCKS``."""
DEFAULT_BLOCKS = (64, 64, 64)


@functools.cache
def _kernel() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid_m, pid_n, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_base = a_ptr + batch * sab
        b_base = b_ptr + batch * sbb
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            a = tl.load(a_base + rm[:, None] * sam + ks[None, :] * sak,
                        mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk + rn[None, :] * sbn,
                        mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        c = c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return SimpleNamespace(triton=triton, bmm=bmm_kernel)


def _forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    k = _kernel()
    batch, m, kk = a.shape
    n = b.shape[2]
    if b.shape[:2] != (batch, kk) or b.dtype != a.dtype:
        raise ValueError(f"invariant_bmm: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} "
                         f"must be [B, M, K] and [B, K, N] of one dtype")
    c = torch.empty(batch, m, n, dtype=a.dtype, device=a.device)
    bm, bn, bk = BLOCKS.get(a.dtype, DEFAULT_BLOCKS)
    grid = (k.triton.cdiv(m, bm), k.triton.cdiv(n, bn), batch)
    k.bmm[grid](a, b, c, m, n, kk, *a.stride(), *b.stride(), *c.stride(),
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=a.dtype in (torch.float32, torch.float64))
    return c


class InvariantBmm(torch.autograd.Function):
    """c = a @ b through the invariant kernel; gradients through torch.matmul."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _forward(a, b)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        grad_a = grad @ b.transpose(1, 2) if ctx.needs_input_grad[0] else None
        grad_b = a.transpose(1, 2) @ grad if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c[i] = a[i] @ b[i]; a [B, M, K], b [B, K, N] -> c [B, M, N] with batch-invariant bits (see module)."""
    return InvariantBmm.apply(a, b)
