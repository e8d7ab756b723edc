"""GPU check and timing of the SGMV Triton kernels (``lathe.kernels.sgmv_triton``); needs a CUDA device.

1. Checks the kernels on the GPU against the torch reference (``lathe.kernels.lora``): a small fp32
   problem with empty segments, repeated slots and an unused slot (tight, float64 reference, BGMV
   included), then the benchmark problem in bf16 against an fp32 reference of the same inputs, and
   that a segment's output has the same bits alone as in the batch.
2. Times, with CUDA events after warmup (median; L2 flushed before each iteration unless --no-flush):
   a device copy (the bandwidth yardstick), the base GEMM forward and forward+backward with the weight
   frozen (y = x @ W, dx = dy @ W.T), SGMV shrink, SGMV expand into the base output, the same two as
   BGMV (one slot index per token), and the LoRA forward and forward+backward on the kernels and on
   the torch reference loop (``measure``; ``bench/gpu_check.py`` reuses it).
3. Prints a table (time, minimum bytes moved, achieved bandwidth and its share of the copy bandwidth)
   and the ratios: LoRA over the base GEMM (next to the FLOP ratio) and the reference over the kernels.
``measure_bgmv_decode`` times BGMV at a sampler decode step's shape (the slot pool's path) for
``bench/gpu_check.py``.

Defaults: rank 32, hidden 4096, 8 adapters, 4096 tokens, bf16.
Run: python bench/gpu_sgmv.py [--tokens 4096 --hidden 4096 --rank 32 --adapters 8 --layout equal]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lathe.kernels import lora
from lathe.kernels import sgmv_triton as st
from lathe.kernels.sgmm_triton import max_segment_len

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class Shape:
    tokens: int
    hidden: int
    out: int
    rank: int
    adapters: int

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "out", "rank", "adapters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="packed tokens T")
    p.add_argument("--hidden", type=int, default=4096, help="input width H (and the base GEMM's K)")
    p.add_argument("--out", type=int, default=None, help="output width O (default: --hidden)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank R")
    p.add_argument("--adapters", type=int, default=8, help="adapter slots N, one segment each")
    p.add_argument(
        "--layout", choices=["equal", "skewed"], default="equal",
        help="equal: T/N tokens per adapter; skewed: half the tokens to adapter 0, the rest shared",
    )  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-flush", action="store_true", help="keep L2 warm between iterations")
    return p.parse_args(argv)


def segments(
    tokens: int, adapters: int, layout: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """seg [N+1] and ids [N]: one segment per adapter, in slot order."""
    if layout == "skewed" and adapters > 1:
        lengths = [tokens // 2] + [tokens // 2 // (adapters - 1)] * (adapters - 1)
    else:
        lengths = [tokens // adapters] * adapters
    lengths[-1] += tokens - sum(lengths)
    seg = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    return seg, torch.arange(adapters, device=device)


def problem(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs scaled so that every output is of order 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, H, O, R, N = shape.tokens, shape.hidden, shape.out, shape.rank, shape.adapters  # noqa: E741
    return {
        "x": torch.randn(T, H, generator=gen, device=device).to(dtype),
        "A": (torch.randn(N, R, H, generator=gen, device=device) / H**0.5).to(dtype),
        "B": (torch.randn(N, O, R, generator=gen, device=device) / R**0.5).to(dtype),
        "scale": torch.rand(N, generator=gen, device=device) + 0.5,
        "dy": (torch.randn(T, O, generator=gen, device=device) / T**0.5).to(dtype),
    }


def forward_backward(
    delta: Callable[..., torch.Tensor], p: dict[str, torch.Tensor], seg: torch.Tensor, ids: torch.Tensor
) -> list[torch.Tensor]:
    """[y, dx, dA, dB] of delta(x, A, B, scale, seg, ids) for the upstream gradient p["dy"]."""
    x, A, B = (p[k].detach().requires_grad_() for k in ("x", "A", "B"))
    y = delta(x, A, B, p["scale"], seg, ids)
    y.backward(p["dy"])
    return [y.detach(), x.grad, A.grad, B.grad]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def compare(
    p: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], seg: torch.Tensor, ids: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (kernel result, reference result)} for y, dx, dA and dB."""
    got = forward_backward(st.lora_delta_triton, p, seg, ids)
    want = forward_backward(lora.lora_delta, ref, seg, ids)
    return dict(zip(["y", "dx", "dA", "dB"], zip(got, want, strict=True), strict=True))


def check(shape: Shape, dtype: torch.dtype, layout: str, device: torch.device) -> None:
    """Exit with a message unless the kernels match the reference on this GPU."""
    failures: list[str] = []
    # small fp32: empty segments, repeated slots, slot 3 unused, odd widths; fp32 dots are IEEE
    seg = torch.tensor([0, 0, 70, 70, 181, 300], device=device)
    ids = torch.tensor([1, 2, 0, 2, 1], device=device)
    small = problem(Shape(300, 136, 200, 12, 4), torch.float32, device, seed=1)
    for name, (got, want) in compare(small, {k: t.double() for k, t in small.items()}, seg, ids).items():
        if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4):
            failures.append(f"fp32 {name}: max abs err {float((got.double() - want).abs().max()):.3g}")
    idx = torch.tensor([0, -1, 3, 2, -1, 1] * 50, device=device)
    slot, used = idx.clamp(min=0), (idx >= 0)[:, None]
    v = st.bgmv_shrink(small["x"], small["A"], idx)
    want_v = torch.einsum("th,trh->tr", small["x"].double(), small["A"].double()[slot]) * used
    base = torch.randn(300, 200, device=device)
    y = st.bgmv_expand(v, small["B"], idx, small["scale"], base.clone())
    want_y = torch.einsum("tr,tor->to", v.double(), small["B"].double()[slot])
    want_y = want_y * small["scale"][slot, None] * used
    for name, got, want in [("bgmv_shrink", v, want_v), ("bgmv_expand", y, base.double() + want_y)]:
        if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4):
            failures.append(f"fp32 {name}")
    # the benchmark problem in low precision against fp32 math on the same inputs
    seg, ids = segments(shape.tokens, shape.adapters, layout, device)
    p = problem(shape, dtype, device)
    for name, (got, want) in compare(p, {k: t.float() for k, t in p.items()}, seg, ids).items():
        err = rel_err(got, want)
        print(f"check {dtype} {name}: relative error {err:.2e}")
        if err > 2e-2:
            failures.append(f"{dtype} {name}: relative error {err:.2e}")
    first = slice(int(seg[0]), int(seg[1]))
    alone = st.lora_delta_triton(p["x"][first], p["A"], p["B"], p["scale"], seg[:2] - seg[0], ids[:1])
    if not torch.equal(alone, st.lora_delta_triton(p["x"], p["A"], p["B"], p["scale"], seg, ids)[first]):
        failures.append("segment 0 alone and in the batch differ in bits")
    if failures:
        sys.exit("kernels disagree with the reference:\n  " + "\n  ".join(failures))
    print("check: the kernels match the reference (fp32 tight, BGMV included; low precision within 2e-2)")
    print("check: a segment's output has the same bits alone and in the batch")


def time_ms(fn: Callable[[], object], warmup: int, iters: int, flush: torch.Tensor | None) -> float:
    """Median milliseconds of fn over iters CUDA-event-timed calls, after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(
    shape: Shape, dtype: torch.dtype, layout: str, device: torch.device, warmup: int, iters: int, flush: bool
) -> dict[str, tuple[float, int]]:
    """{row: (median ms, minimum bytes moved)} for a device copy (the yardstick), the base GEMM, the SGMV
    and BGMV kernels (BGMV with the same tokens, one slot index per token) and the LoRA delta on the
    kernels and on the torch reference. L2 is flushed before each timed call when ``flush``."""
    T, H, O, R, N = shape.tokens, shape.hidden, shape.out, shape.rank, shape.adapters  # noqa: E741
    seg, ids = segments(T, N, layout, device)
    idx = torch.repeat_interleave(ids, seg.diff())
    max_len = max_segment_len(seg)  # the packer knows it; keeps a device sync out of the timings
    p = problem(shape, dtype, device)
    x, A, B, scale, dy = p["x"], p["A"], p["B"], p["scale"], p["dy"]
    W = torch.randn(H, O, device=device, dtype=dtype) / H**0.5
    v = st.sgmv_shrink(x, A, seg, ids, max_len=max_len)
    base_out = x @ W
    leaves = [t.detach().requires_grad_() for t in (x, A, B)]
    x_leaf = x.detach().requires_grad_()
    flusher = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if flush else None
    copy_src = torch.empty(2**30, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)

    def triton_delta(*a: torch.Tensor) -> torch.Tensor:
        return st.lora_delta_triton(*a, seg, ids, max_len)

    def torch_delta(*a: torch.Tensor) -> torch.Tensor:
        return lora.lora_delta(*a, seg, ids)

    def fwd_bwd(delta: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for t in leaves:
                t.grad = None
            delta(*leaves, scale).backward(dy)

        return run

    def base_fwd_bwd() -> None:
        x_leaf.grad = None
        (x_leaf @ W).backward(dy)

    e = x.element_size()
    shrink_bytes = e * (T * H + N * R * H + T * R)
    expand_bytes = e * (T * R + N * O * R + 2 * T * O)
    fwd_bytes = e * (T * H + N * R * H + 2 * T * R + N * O * R + T * O)
    bwd_bytes = e * (
        (T * O + N * O * R + T * R)  # dv = dy @ B * scale
        + (T * R + N * R * H + T * H)  # dx = dv @ A
        + (T * R + T * H + N * R * H)  # dA = dv.T @ x
        + (T * O + T * R + N * O * R)  # dB = dy.T @ v * scale
    )
    rows: dict[str, tuple[Callable[[], object], int]] = {
        "device copy 1 GiB": (lambda: copy_dst.copy_(copy_src), 2 * copy_src.numel()),
        "base GEMM fwd": (lambda: x @ W, e * (T * H + H * O + T * O)),
        "base GEMM fwd+bwd, W frozen": (base_fwd_bwd, 2 * e * (T * H + H * O + T * O)),
        "sgmv shrink": (lambda: st.sgmv_shrink(x, A, seg, ids, max_len=max_len), shrink_bytes),
        "sgmv expand, += base": (
            lambda: st.sgmv_expand(v, B, seg, ids, scale, base_out, max_len=max_len), expand_bytes,
        ),
        "bgmv shrink": (lambda: st.bgmv_shrink(x, A, idx), shrink_bytes),
        "bgmv expand, += base": (lambda: st.bgmv_expand(v, B, idx, scale, base_out), expand_bytes),
        "lora fwd, triton": (lambda: triton_delta(x, A, B, scale), fwd_bytes),
        "lora fwd, torch ref": (lambda: torch_delta(x, A, B, scale), fwd_bytes),
        "lora fwd+bwd, triton": (fwd_bwd(triton_delta), fwd_bytes + bwd_bytes),
        "lora fwd+bwd, torch ref": (fwd_bwd(torch_delta), fwd_bytes + bwd_bytes),
    }
    return {name: (time_ms(fn, warmup, iters, flusher), nbytes) for name, (fn, nbytes) in rows.items()}



def measure_bgmv_decode(
    tokens: int, hidden: int, rank: int, slots: int, dtype: torch.dtype, device: torch.device, warmup: int, iters: int
) -> dict[str, object]:
    """BGMV at a decode step's shape (``tokens`` rows, one slot index each, every slot used, one row in 8
    without an adapter) through ``lathe.sampler.slots.BGMV``: the Triton kernels against the torch reference
    (relative error of the delta against fp32 math on the same inputs), and each one's median ms, bytes and
    GB/s, with a 1 GiB device copy's GB/s as the yardstick. L2 is flushed before each timed call."""
    from lathe.sampler.slots import BGMV

    shape = Shape(tokens, hidden, hidden, rank, slots)
    p = problem(shape, dtype, device, seed=3)
    idx = torch.arange(tokens, device=device) % slots
    idx[::8] = -1
    x, A, B, scale = p["x"], p["A"], p["B"], p["scale"]
    want = BGMV["torch"](x.float(), A.float(), B.float(), scale, idx)
    err = rel_err(BGMV["triton"](x, A, B, scale, idx), want)
    flusher = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / time_ms(lambda: dst.copy_(src), warmup, iters, flusher) / 1e6
    v = st.bgmv_shrink(x, A, idx)
    e = x.element_size()
    shrink_bytes = e * (tokens * hidden + slots * rank * hidden + tokens * rank)
    expand_bytes = e * (tokens * rank + slots * hidden * rank + tokens * hidden)
    rows = {
        "bgmv shrink, triton": (lambda: st.bgmv_shrink(x, A, idx), shrink_bytes),
        "bgmv expand, triton": (lambda: st.bgmv_expand(v, B, idx, scale, add=False), expand_bytes),
        "bgmv delta, triton": (lambda: BGMV["triton"](x, A, B, scale, idx), shrink_bytes + expand_bytes),
        "bgmv delta, torch ref": (lambda: BGMV["torch"](x, A, B, scale, idx), shrink_bytes + expand_bytes),
    }
    out: dict[str, object] = {"shape": {"tokens": tokens, "hidden": hidden, "rank": rank, "slots": slots,
                                        "dtype": str(dtype)},
                              "relative error vs fp32": err, "correct": err < 2e-2, "copy GB/s": round(copy_gbs, 1)}
    for name, (fn, nbytes) in rows.items():
        ms = time_ms(fn, warmup, iters, flusher)
        gbs = nbytes / ms / 1e6
        out[name] = {"ms": round(ms, 4), "MB": round(nbytes / 1e6, 2), "GB/s": round(gbs, 1),
                     "% of copy": round(100 * gbs / copy_gbs, 1)}
    return out

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_sgmv needs a CUDA device")
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    shape = Shape(args.tokens, args.hidden, args.out or args.hidden, args.rank, args.adapters)
    T, H, O, R, N = shape.tokens, shape.hidden, shape.out, shape.rank, shape.adapters  # noqa: E741
    print(f"{torch.cuda.get_device_name()}: T={T} H={H} O={O} R={R} N={N} {args.dtype} layout={args.layout}")
    check(shape, dtype, args.layout, device)
    rows = measure(shape, dtype, args.layout, device, args.warmup, args.iters, not args.no_flush)
    ms = {name: t for name, (t, _) in rows.items()}
    copy_gbs = rows["device copy 1 GiB"][1] / ms["device copy 1 GiB"] / 1e6

    print(f"\n{'op':30} {'ms':>9} {'min MB':>9} {'GB/s':>8} {'of copy BW':>11}")
    for name, (t, nbytes) in rows.items():
        gbs = nbytes / t / 1e6
        print(f"{name:30} {t:9.4f} {nbytes / 1e6:9.1f} {gbs:8.0f} {100 * gbs / copy_gbs:10.1f}%")
    base_fwd, base_fb = ms["base GEMM fwd"], ms["base GEMM fwd+bwd, W frozen"]
    ratios = {
        "LoRA FLOPs / base GEMM FLOPs": 100 * R * (H + O) / (H * O),  # 2TR(H+O) / 2THO, fwd and bwd alike
        "LoRA fwd / base GEMM fwd, triton": 100 * ms["lora fwd, triton"] / base_fwd,
        "LoRA fwd / base GEMM fwd, torch ref": 100 * ms["lora fwd, torch ref"] / base_fwd,
        "LoRA fwd+bwd / base fwd+bwd, triton": 100 * ms["lora fwd+bwd, triton"] / base_fb,
        "LoRA fwd+bwd / base fwd+bwd, torch ref": 100 * ms["lora fwd+bwd, torch ref"] / base_fb,
    }
    print(f"\nbase GEMM {2 * T * H * O / ms['base GEMM fwd'] / 1e9:.0f} TFLOP/s, copy {copy_gbs:.0f} GB/s")
    for name, pct in ratios.items():
        print(f"{name:40} {pct:7.2f}%")
    for what in ("fwd", "fwd+bwd"):
        speedup = ms[f"lora {what}, torch ref"] / ms[f"lora {what}, triton"]
        print(f"{'triton speedup over torch ref, ' + what:40} {speedup:7.2f}x")


if __name__ == "__main__":
    main()
