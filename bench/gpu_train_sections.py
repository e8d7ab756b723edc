"""The training-side sections of ``bench/gpu_check.py``, each recording into a ``Context``:

    tests      the ``gpu``-marked tests (tests/test_gpu_pools.py, tests/test_cuda_graphs.py) through pytest, results
               from its JUnit XML
    sgmv       SGMV/BGMV kernels: ``bench/gpu_sgmv.py``'s check and its timings against a device copy
    exactness  ``lathe.models.exactness.self_check`` on the GPU decoder, where that module exists
    cycle      8 tenants x (1 x 128 tokens) forward_backward + optim_step: one packed cycle vs one tenant per cycle
    ranks      the trainer pool's collectives in a pool of one rank, against the plain packed pass

The cycle and ranks sections drive the trainer's compute (``trainer.step.run_jobs`` + ``adamw_step``) without the
engine's queues and threads, which need the generated protobuf code.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import torch
from gpu_context import Context, example, gpu_variants, median_s, random_adapters, random_model, random_tokens, sync

from lathe.kernels.sgmv_triton import triton_available
from lathe.models.lora import LoraWeights
from lathe.trainer.optimizer import AdamState, adamw_step
from lathe.trainer.step import Job, run_jobs
from lathe.types import AdamParams

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a. the gpu-marked tests


def tests(ctx: Context) -> None:
    import pytest

    xml = ctx.scratch / "pytest.xml"
    files = [str(REPO / "tests" / name) for name in ("test_gpu_pools.py", "test_cuda_graphs.py")]
    code = pytest.main([*files, "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                        "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), f"--junitxml={xml}",
                        f"--basetemp={ctx.scratch / 'pytest-tmp'}"])
    ctx.record("exit code", int(code))
    outcomes: dict[str, dict[str, object]] = {}
    for case in ET.parse(xml).iter("testcase") if xml.exists() else []:
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, (node.get("message") or "") + "\n" + (node.text or "")
        outcomes[case.get("name", "?")] = {"outcome": outcome, "seconds": float(case.get("time", 0)),
                                           "message": message.strip()[-3000:]}
    ctx.record("tests", outcomes)
    counts = {k: sum(o["outcome"] == k for o in outcomes.values()) for k in ("passed", "failure", "error", "skipped")}
    ctx.record("counts", counts)


# ---------------------------------------------------------------- b. SGMV / BGMV


def sgmv(ctx: Context) -> None:
    if not ctx.cuda:
        return ctx.skip("needs a CUDA device (the Triton kernels are compiled for it); torch sees none here")
    if not triton_available():
        return ctx.skip("Triton cannot run kernels here (not installed, or no GPU driver)")
    import gpu_sgmv  # bench/, the script's own folder

    tokens, hidden, rank, adapters = ctx.sizes.sgmv
    shape = gpu_sgmv.Shape(tokens, hidden, hidden, rank, adapters)
    ctx.record("shape", asdict(shape) | {"dtype": "bf16", "layout": "equal"})
    try:
        gpu_sgmv.check(shape, torch.bfloat16, "equal", torch.device("cuda"))
        ctx.record("correct", True)
    except SystemExit as e:  # check() exits with the list of disagreements
        ctx.record("correct", False)
        ctx.record("disagreements", str(e.code))
    rows = gpu_sgmv.measure(shape, torch.bfloat16, "equal", torch.device("cuda"), warmup=5, iters=20, flush=True)
    copy_ms, copy_bytes = rows["device copy 1 GiB"]
    copy_gbs = copy_bytes / copy_ms / 1e6
    ctx.record("copy GB/s", round(copy_gbs, 1))
    ctx.record("rows", {name: {"ms": round(ms, 4), "MB": round(b / 1e6, 2), "GB/s": round(b / ms / 1e6, 1),
                               "% of copy": round(100 * b / ms / 1e6 / copy_gbs, 1)} for name, (ms, b) in rows.items()})


# ---------------------------------------------------------------- c. exactness self-check


def exactness(ctx: Context) -> None:
    try:
        from lathe.models.exactness import self_check
    except ImportError as e:
        return ctx.skip(f"lathe.models.exactness.self_check is not importable: {e}")
    _, _, model = random_model(ctx)
    t0 = time.perf_counter()
    try:
        report = self_check(model, lora_rank=8)
    except TypeError as e:
        return ctx.skip(f"self_check(decoder, lora_rank=8) does not fit its API: {e}")
    ctx.record("seconds", round(time.perf_counter() - t0, 2))
    for name in ("exact", "first_failure", "fingerprint"):
        ctx.record(name, getattr(report, name, "(no such attribute)"))
    to_dict = getattr(report, "to_dict", None)
    ctx.record("report", to_dict() if callable(to_dict) else repr(report))


# ---------------------------------------------------------------- d. clock cycles


def cycle(ctx: Context) -> None:
    s = ctx.sizes
    _, _, model = random_model(ctx)
    tenants = [(w, AdamState.zeros(w.named_parameters())) for w in random_adapters(ctx, model.cfg, s.tenants)]
    data = [example(t) for t in random_tokens(s.vocab, s.tenants, s.tenant_tokens + 1, seed=1)]
    hp = AdamParams(learning_rate=1e-5)

    def run(group: list[int]) -> None:
        """One cycle: one packed forward_backward over ``group``'s tenants, then each one's optim_step."""
        results = run_jobs(model, [Job(tenants[i][0], [data[i]], "cross_entropy", {}, True) for i in group])
        if any(r.error is not None for r in results):
            raise RuntimeError(f"a job failed: {[str(r.error) for r in results if r.error is not None]}")
        for i in group:
            adamw_step(tenants[i][0].named_parameters(), tenants[i][1], hp)

    everyone = list(range(s.tenants))
    tokens = s.tenants * s.tenant_tokens
    for use_sgmv in gpu_variants(ctx):
        model.sgmv = use_sgmv
        packed, _ = median_s(ctx, lambda: run(everyone))
        serial, _ = median_s(ctx, lambda: [run([i]) for i in everyone])
        ctx.record("sgmv" if use_sgmv else "per-segment LoRA", {
            "tenants": s.tenants, "tokens per tenant": s.tenant_tokens,
            "packed cycle s": round(packed, 4), "serial: one cycle per tenant, total s": round(serial, 4),
            "packed tokens/s": round(tokens / packed, 1), "serial tokens/s": round(tokens / serial, 1),
            "packed / serial": round(serial / packed, 3), "target": 3.0,
        })
    if ctx.cuda:
        ctx.record("peak GPU memory GiB", round(torch.cuda.max_memory_allocated() / 2**30, 2))


def ranks(ctx: Context) -> None:
    """The trainer pool's collectives (``lathe.trainer.dist``: NCCL on cuda, gloo on cpu) in a pool of one rank:
    a cycle through the sharded path (plan broadcast, results gather, one gradient all_gather) gives the same
    losses, logprobs and gradients as the plain packed pass, bit for bit."""
    from lathe.trainer.dist import PoolConfig, free_port, join
    from lathe.trainer.shard import run_sharded

    s = ctx.sizes
    _, _, model = random_model(ctx)
    data = [example(t) for t in random_tokens(s.vocab, s.tenants, s.tenant_tokens + 1, seed=3)]

    def jobs_of(adapters: list[LoraWeights]) -> list[Job]:  # every third tenant forward-only
        return [Job(w, [data[i]], "cross_entropy", {}, i % 3 != 2) for i, w in enumerate(adapters)]

    plain, sharded = random_adapters(ctx, model.cfg, s.tenants), random_adapters(ctx, model.cfg, s.tenants)
    expected = run_jobs(model, jobs_of(plain))
    group = join(PoolConfig(world_size=1, rank=0, master_port=free_port(), timeout_s=120), ctx.device, ctx.dtype)
    try:
        plan = group.broadcast({"cycle": 1, "tenants": s.tenants})
        t0 = time.perf_counter()
        got = run_sharded(group, jobs_of(sharded), lambda jobs: run_jobs(model, jobs))
        sync(ctx.device)
        seconds, backend = time.perf_counter() - t0, group.backend
        collectives = dict(group.seconds)
    finally:
        group.close()
    same_results = all(a.error is None and b.error is None and a.loss == b.loss and len(a.logprobs) == len(b.logprobs)
                       and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
                       for a, b in zip(expected, got, strict=True))
    same_grads = all((p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
                     for w, v in zip(plain, sharded, strict=True)
                     for p, q in zip(w.named_parameters().values(), v.named_parameters().values(), strict=True))
    ctx.record("pool of one", {"backend": backend, "plan broadcast": plan == {"cycle": 1, "tenants": s.tenants},
                               "results equal": same_results, "gradients equal": same_grads,
                               "sharded cycle s": round(seconds, 4),
                               "collective s": {k: round(v, 4) for k, v in collectives.items()}})
    if not (same_results and same_grads):
        raise RuntimeError(f"the {backend} pool of one differs from the plain pass (results equal: {same_results}, "
                           f"gradients equal: {same_grads})")
