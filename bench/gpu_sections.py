"""The sections of ``bench/gpu_check.py``: each runs in its own child process and records into a ``Context``.

    env        versions, GPU, CPU model and flags
    tests      the ``gpu``-marked tests (tests/test_gpu_pools.py, tests/test_cuda_graphs.py) through pytest, results
               from its JUnit XML
    sgmv       SGMV/BGMV kernels: ``bench/gpu_sgmv.py``'s check and its timings against a device copy
    exactness  ``lathe.models.exactness.self_check`` on the GPU decoder, where that module exists
    cycle      8 tenants x (1 x 128 tokens) forward_backward + optim_step: one packed cycle vs one tenant per cycle
    sampler    64 sequences over 8 adapters: the sampler's steps vs transformers + peft ``generate``, and the
               sampler-trainer KL (the sampled tokens' logprobs recomputed by the trainer's forward)
    bgmv       BGMV at a decode step's shape (the slot pool's path): Triton vs the torch reference, GB/s vs a copy
    decode     paged-KV decode attention; decode tokens/s with CUDA graphs on vs off; the slot-pool (BGMV,
               throughput) decode path vs the invariant per-segment path: tokens/s and logprob differences

Models are random (no download): a 1B-class Llama (``FULL``; ``SMOKE`` is tiny) whose weights are drawn on
the device. Trainer adapters are fp32 on the device, the base and the sampler's adapters in ``--dtype``.
The cycle and sampler sections drive the engines' compute (``trainer.step.run_jobs`` + ``adamw_step``,
``sampler.step.run_step``) without the engines' queues and threads, which need the generated protobuf code.
Nothing here writes outside ``Context.scratch``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from lathe.kernels import attention as attn
from lathe.kernels.sgmv_triton import triton_available
from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.pool import DTYPES
from lathe.models.tiny import hf_config, tensor_shapes
from lathe.sampler.adapters import adapter_dtype, load_adapter
from lathe.sampler.blocks import blocks_for
from lathe.sampler.graphs import DecodeRunner, GraphConfig
from lathe.sampler.kv import KVPool, StepKV
from lathe.sampler.sampling import Rule, choose
from lathe.sampler.slots import SlotPool
from lathe.sampler.step import Item, ItemOut, run_step
from lathe.trainer.bank import Adapter
from lathe.trainer.optimizer import AdamState, adamw_step
from lathe.trainer.step import Job, run_jobs
from lathe.trainer.validate import Example
from lathe.types import AdamParams

REPO = Path(__file__).resolve().parents[1]
BASE = "gpu-check/random-llama"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every shape the sections use."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rank: int  # LoRA rank of every adapter
    tenants: int  # cycle: tenants, each with one sequence of ``tenant_tokens``
    tenant_tokens: int
    sequences: int  # sampler: sequences over ``adapters`` adapters
    adapters: int
    prompt_tokens: int
    new_tokens: int
    repeats: int  # timed runs after one warm-up (median reported)
    sgmv: tuple[int, int, int, int]  # kernel problem: tokens, hidden, rank, adapters
    decode_context: int  # decode section: tokens already cached per sequence in the attention timing


FULL = Sizes(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000, rank=32, tenants=8,
             tenant_tokens=128, sequences=64, adapters=8, prompt_tokens=64, new_tokens=64, repeats=3,
             sgmv=(4096, 4096, 32, 8), decode_context=1024)
SMOKE = Sizes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, rank=4, tenants=4,
              tenant_tokens=16, sequences=8, adapters=4, prompt_tokens=8, new_tokens=4, repeats=1,
              sgmv=(256, 256, 8, 4), decode_context=100)


@dataclass(slots=True)
class Context:
    """What a section knows, and where it records: ``record`` rewrites ``path`` at once, so a section killed
    at its time limit still leaves what it had measured."""

    path: Path
    scratch: Path
    device: str
    dtype: str
    sizes: Sizes
    protos: str  # how lathe.v1 was imported (the generated code, or a stub and why)
    data: dict[str, Any] = field(default_factory=lambda: {"status": "running", "results": {}})

    def record(self, key: str, value: object) -> None:
        self.data["results"][key] = value
        self.write()

    def skip(self, reason: str) -> None:
        self.data.update(status="skipped", reason=reason)
        self.write()

    def fail(self, exc: BaseException) -> None:
        self.data.update(status="error", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# ---------------------------------------------------------------- shared pieces


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_s(ctx: Context, run: Callable[[], T]) -> tuple[float, T]:
    """Median wall seconds of ``run`` over ``repeats`` timed calls after one warm-up call, and the last
    call's result."""
    result = run()
    times = []
    for _ in range(ctx.sizes.repeats):
        sync(ctx.device)
        t0 = time.perf_counter()
        result = run()
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def random_model(ctx: Context, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor], Decoder]:
    """(HF config, HF-named weights in the pool dtype on the device, the decoder over them)."""
    s = ctx.sizes
    config = hf_config("llama", vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       head_dim=s.hidden // s.heads, max_position_embeddings=2048, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    weights = {}
    for name, shape in tensor_shapes(config).items():  # norms U(0.5, 1.5), matrices N(0, 1/fan_in), as tiny.py
        if name.endswith("norm.weight"):
            t = torch.rand(shape, generator=gen, device=ctx.device) + 0.5
        else:
            t = torch.randn(shape, generator=gen, device=ctx.device) / shape[1] ** 0.5
        weights[name] = t.to(DTYPES[ctx.dtype])
    model = Decoder.from_weights(ModelConfig.from_hf(config), weights, dtype=DTYPES[ctx.dtype], device=ctx.device)
    return config, weights, model


def random_adapters(ctx: Context, cfg: ModelConfig, n: int) -> list[LoraWeights]:
    """``n`` fp32 trainer adapters of rank ``sizes.rank`` on every target, B random and non-zero."""
    out = []
    for i in range(n):
        w = LoraWeights.init(cfg, LoraSpec(rank=ctx.sizes.rank), seed=100 + i, device=ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(200 + i)
        with torch.no_grad():
            for b in w.b.values():
                b.copy_(torch.randn(b.shape, generator=gen, device=ctx.device) * 0.01)
        out.append(w)
    return out


def example(tokens: list[int]) -> Example:
    return Example(tokens[:-1], torch.tensor(tokens[1:]), {"weights": torch.ones(len(tokens) - 1)})


def random_tokens(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    return torch.randint(vocab, (rows, length), generator=torch.Generator().manual_seed(seed)).tolist()


def gpu_variants(ctx: Context) -> list[bool]:
    """The LoRA paths to measure: per-segment everywhere, SGMV too where the Triton kernels run."""
    return [False, True] if ctx.cuda and triton_available() else [False]


# ---------------------------------------------------------------- g. environment


def env(ctx: Context) -> None:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torch cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "peft", "google.protobuf", "grpc", "safetensors", "pytest"):
        try:
            versions[mod] = getattr(__import__(mod, fromlist=["__version__"]), "__version__", "?")
        except ImportError as e:
            versions[mod] = f"not importable: {e}"
    ctx.record("versions", versions)
    ctx.record("lathe.v1", ctx.protos)
    gpu: dict[str, object] = {"available": torch.cuda.is_available(), "pool device": ctx.device}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu |= {"name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory GiB": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count(),
                "triton kernels": triton_available()}
    ctx.record("gpu", gpu)
    cpu: dict[str, object] = {"cores": os.cpu_count()}
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        cpu |= {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)
                if k.strip() in ("Model name", "Flags")}
    except (OSError, subprocess.SubprocessError) as e:
        cpu["lscpu"] = f"failed: {e}"
    ctx.record("cpu", cpu)


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


# ---------------------------------------------------------------- e, f. sampler throughput and KL


def lathe_generate(model: Decoder, prompts: list[list[int]], adapters: list[LoraWeights], new_tokens: int
                   ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy through the sampler's steps: every prompt prefilled in one step (as the engine admits 64
    prompts of 64 tokens), then one decode step per token for all; (tokens, their logprobs) per sequence."""
    pool = KVPool.for_model(model, len(prompts) * blocks_for(max(map(len, prompts)) + new_tokens) + 1)
    caches = [pool.sequence(b"") for _ in prompts]
    feed = [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    greedy, gen = Rule(temperature=0.0), torch.Generator()
    for _ in range(new_tokens):
        outs = run_step(model, [Item(f, c, a) for f, c, a in zip(feed, caches, adapters, strict=True)])
        for i, out in enumerate(outs):
            token = choose(out.logits, greedy, gen)
            tokens[i].append(token)
            logprobs[i].append(float(out.logprobs[token]))
            feed[i] = [token]
    return tokens, logprobs


def kl_against_trainer(model: Decoder, prompts: list[list[int]], tokens: list[list[int]],
                       logprobs: list[list[float]], trainer_w: list[LoraWeights]) -> dict[str, object]:
    """The sampled tokens' logprobs vs the trainer's forward (one packed pass) on the same tokens."""
    jobs = [Job(w, [example(p + t)], "cross_entropy", {}, False)
            for p, t, w in zip(prompts, tokens, trainer_w, strict=True)]
    deltas = []
    for p, lps, res in zip(prompts, logprobs, run_jobs(model, jobs), strict=True):
        deltas.append(torch.tensor(lps, dtype=torch.float32) - res.logprobs[0][len(p) - 1:])
    d = torch.cat(deltas).double()
    return {"tokens": d.numel(), "mismatched": int((d != 0).sum()), "KL (mean of sampler - trainer logprob)":
            float(d.mean()), "max |delta logprob|": float(d.abs().max()), "target": 0.0}


def hf_twin(config: dict, weights: dict[str, torch.Tensor], adapters: list[LoraWeights], ctx: Context
            ) -> torch.nn.Module:
    """transformers' Llama over the same weights, with the same adapters loaded into peft as a0, a1, ..."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(ctx.device):
        model = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(DTYPES[ctx.dtype]).eval()
    model.load_state_dict(weights, strict=True)
    model.generation_config.eos_token_id = None  # every sequence makes exactly new_tokens tokens
    peft_cfg = Adapter("a", "t", BASE, adapters[0], AdamState({}, {})).peft_config()
    lora = LoraConfig(**{k: v for k, v in peft_cfg.items() if k != "peft_type"})
    peft_model = get_peft_model(model, lora, adapter_name="a0")
    for i, w in enumerate(adapters):
        if i:
            peft_model.add_adapter(f"a{i}", lora)
        result = set_peft_model_state_dict(peft_model, w.state_dict(), adapter_name=f"a{i}")
        if result.unexpected_keys:
            raise RuntimeError(f"peft did not take adapter {i}'s tensors: {result.unexpected_keys[:3]}")
    return peft_model.eval()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], names: list[str], new_tokens: int,
                device: str) -> list[list[int]]:
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def sampler(ctx: Context) -> None:
    s = ctx.sizes
    config, weights, model = random_model(ctx)
    cfg = model.cfg
    trainer_pool = random_adapters(ctx, cfg, s.adapters)
    which = [i % s.adapters for i in range(s.sequences)]
    prompts = random_tokens(s.vocab, s.sequences, s.prompt_tokens, seed=2)
    total = s.sequences * s.new_tokens
    shape = {"sequences": s.sequences, "adapters": s.adapters, "rank": s.rank, "prompt tokens": s.prompt_tokens,
             "new tokens": s.new_tokens, "dtype": ctx.dtype}
    ctx.record("shape", shape)
    lathe_tokens: list[list[int]] = []
    for use_sgmv in gpu_variants(ctx):
        model.sgmv = use_sgmv
        label = "sgmv" if use_sgmv else "per-segment LoRA"
        pool = [load_adapter(Adapter("a", "t", BASE, w, AdamState({}, {})).sampler_files(), cfg,
                             adapter_dtype(model.dtype, use_sgmv), BASE, ctx.device) for w in trainer_pool]
        per_seq = [pool[k] for k in which]
        seconds, (tokens, logprobs) = median_s(
            ctx, lambda per_seq=per_seq: lathe_generate(model, prompts, per_seq, s.new_tokens))
        lathe_tokens = lathe_tokens or tokens
        ctx.record(f"lathe {label}", {"seconds": round(seconds, 3), "tokens/s": round(total / seconds, 1)})
        ctx.record(f"KL {label}", kl_against_trainer(model, prompts, tokens, logprobs,
                                                     [trainer_pool[k] for k in which]))
    model.sgmv = False
    hf = hf_twin(config, weights, trainer_pool, ctx)
    names = [f"a{k}" for k in which]
    hf_seconds, hf_tokens = median_s(ctx, lambda: hf_generate(hf, prompts, names, s.new_tokens, ctx.device))
    agree = sum(a == b for x, y in zip(lathe_tokens, hf_tokens, strict=True) for a, b in zip(x, y, strict=True))
    first = sum(x[0] == y[0] for x, y in zip(lathe_tokens, hf_tokens, strict=True))
    ctx.record("transformers + peft", {"seconds": round(hf_seconds, 3), "tokens/s": round(total / hf_seconds, 1),
                                       "greedy tokens equal to lathe's": f"{agree}/{total}",
                                       "first tokens equal": f"{first}/{s.sequences}"})
    best = max(v["tokens/s"] for k, v in ctx.data["results"].items() if k.startswith("lathe "))
    ctx.record("lathe / transformers (best lathe path)", {"ratio": round(best / (total / hf_seconds), 3),
                                                          "target": 3.0})
    if ctx.cuda:
        ctx.record("peak GPU memory GiB", round(torch.cuda.max_memory_allocated() / 2**30, 2))



# ---------------------------------------------------------------- BGMV and the decode step


def bgmv(ctx: Context) -> None:
    if not ctx.cuda:
        return ctx.skip("needs a CUDA device (the Triton kernels are compiled for it); torch sees none here")
    if not triton_available():
        return ctx.skip("Triton cannot run kernels here (not installed, or no GPU driver)")
    import gpu_sgmv  # bench/, the script's own folder

    s = ctx.sizes
    for label, slots in (("16 slots", 16), ("64 slots", 64)):
        ctx.record(label, gpu_sgmv.measure_bgmv_decode(s.sequences, s.hidden, s.rank, slots, DTYPES[ctx.dtype],
                                                       torch.device("cuda"), warmup=5, iters=20))


def _paged_attention(ctx: Context) -> dict[str, object]:
    """One layer's decode attention for ``sequences`` sequences of ``decode_context`` cached tokens read through
    their block tables (write the new rows, gather the blocks, attend), invariant and plain."""
    s = ctx.sizes
    heads, kv_heads, head_dim = s.heads, s.kv_heads, s.hidden // s.heads
    blocks = s.sequences * blocks_for(s.decode_context + 1) + 1
    pool = KVPool(1, kv_heads, head_dim, blocks, DTYPES[ctx.dtype], ctx.device, preallocate=True)
    caches = [pool.sequence(b"") for _ in range(s.sequences)]
    for c in caches:
        c.reserve(s.decode_context + 1)
        c.length = s.decode_context
    with torch.inference_mode():
        for t in (pool.k[0], pool.v[0]):
            t.normal_()
            t[0].zero_()  # the null block stays zeros
    step = StepKV(caches, [[1]] * s.sequences)
    gen = torch.Generator(device=ctx.device).manual_seed(4)
    q = torch.randn(s.sequences, heads, head_dim, generator=gen, device=ctx.device).to(DTYPES[ctx.dtype])
    k = torch.randn(s.sequences, kv_heads, head_dim, generator=gen, device=ctx.device).to(DTYPES[ctx.dtype])
    nbytes = 2 * s.sequences * (s.decode_context + 1) * kv_heads * head_dim * pool.k[0].element_size()
    out: dict[str, object] = {"sequences": s.sequences, "context": s.decode_context,
                              "KV MB read": round(nbytes / 1e6, 2)}
    for invariant in (True, False):
        def run(invariant: bool = invariant) -> torch.Tensor:
            ks, vs, positions, table = step.decode(0, k, k)
            return attn.decode_attention(q, ks, vs, positions, scale=head_dim**-0.5, invariant=invariant,
                                         table=table)

        seconds, _ = median_s(ctx, run)
        out["invariant" if invariant else "plain"] = {"ms": round(1e3 * seconds, 4),
                                                      "KV GB/s": round(nbytes / seconds / 1e9, 1)}
    return out


Step = Callable[[list[Item]], list[ItemOut]]


def _decode_run(ctx: Context, model: Decoder, prompts: list[list[int]], owners: list[LoraWeights | None],
                make_step: Callable[[KVPool], Step], forced: list[list[int]] | None = None
                ) -> tuple[float, list[list[int]], list[list[float]]]:
    """Prefill ``prompts`` (run_step), 2 untimed decode steps (graph capture, kernel compilation), then
    ``new_tokens - 4`` timed decode steps through ``make_step(pool)``: (seconds of the timed steps, every
    sequence's tokens from the prefill's on, the logprob of each token after the first). Greedy, or the tokens
    of ``forced`` (another run's), so two paths can be compared on the same inputs."""
    steps = max(ctx.sizes.new_tokens - 4, 1)
    pool = KVPool.for_model(model, len(prompts) * blocks_for(max(map(len, prompts)) + steps + 4) + 1)
    caches = [pool.sequence(b"") for _ in prompts]
    first = run_step(model, [Item(list(p), c, a) for p, c, a in zip(prompts, caches, owners, strict=True)])
    tokens = [[forced[i][0] if forced else int(o.logits.argmax())] for i, o in enumerate(first)]
    logprobs: list[list[float]] = [[] for _ in prompts]
    step = make_step(pool)
    for k in range(steps + 2):
        if k == 2:
            sync(ctx.device)
            t0 = time.perf_counter()
        outs = step([Item([t[-1]], c, a) for t, c, a in zip(tokens, caches, owners, strict=True)])
        for i, o in enumerate(outs):
            token = forced[i][len(tokens[i])] if forced else int(o.logits.argmax())
            tokens[i].append(token)
            logprobs[i].append(float(o.logprobs[token]))
    sync(ctx.device)
    return time.perf_counter() - t0, tokens, logprobs


def decode(ctx: Context) -> None:
    s = ctx.sizes
    ctx.record("paged-KV decode attention, one layer", _paged_attention(ctx))
    _, _, model = random_model(ctx)
    adapters = [LoraWeights(w.spec, {k: t.detach() for k, t in w.a.items()}, {k: t.detach() for k, t in w.b.items()})
                for w in random_adapters(ctx, model.cfg, s.adapters)]
    owners = [adapters[i % s.adapters] for i in range(s.sequences)]
    prompts = random_tokens(s.vocab, s.sequences, s.prompt_tokens, seed=5)
    timed = s.sequences * max(s.new_tokens - 4, 1)

    def rate(seconds: float) -> dict[str, float]:
        return {"seconds": round(seconds, 4), "tokens/s": round(timed / seconds, 1)}

    def runner(slots: SlotPool | None, capture: bool, idx: list[int] | None = None) -> Callable[[KVPool], Step]:
        def make(pool: KVPool) -> Step:
            r = DecodeRunner(model, pool, slots, GraphConfig(capture=capture))
            return lambda items: r.run(items, idx)
        return make

    base = [None] * s.sequences
    graphs: dict[str, object] = {"shape": {"sequences": s.sequences, "timed decode steps": max(s.new_tokens - 4, 1),
                                           "prompt tokens": s.prompt_tokens, "dtype": ctx.dtype}}
    for capture in (False, True) if ctx.cuda else (False,):
        graphs[f"invariant, base model, graphs {'on' if capture else 'off'}"] = rate(
            _decode_run(ctx, model, prompts, base, runner(None, capture))[0])
    if not ctx.cuda:
        graphs["graphs on"] = "not measured: CUDA graphs need a CUDA device"
    ctx.record("decode with CUDA graphs on vs off", graphs)

    seg_seconds, seg_tokens, seg_lps = _decode_run(ctx, model, prompts, owners, lambda pool: (
        lambda items: run_step(model, items)))
    paths: dict[str, object] = {"invariant, per-segment LoRA, eager (run_step)": rate(seg_seconds)}
    impl = "triton" if ctx.cuda and triton_available() else "torch"
    model.invariant = False
    slots = SlotPool(model.cfg, s.adapters, s.rank, model.dtype, ctx.device, impl)
    idx = slots.place([(id(w), w) for w in owners])
    for capture in (False, True) if ctx.cuda else (False,):
        seconds, _, lps = _decode_run(ctx, model, prompts, owners, runner(slots, capture, idx), forced=seg_tokens)
        d = (torch.tensor(lps, dtype=torch.float64) - torch.tensor(seg_lps, dtype=torch.float64)).abs()
        paths[f"slots + {impl} BGMV, plain ops, graphs {'on' if capture else 'off'}"] = rate(seconds) | {
            "max |delta logprob| vs invariant path": float(d.max()), "mean |delta|": float(d.mean()),
            "tokens differing in bits": f"{int((d != 0).sum())}/{d.numel()}"}
    model.invariant = True
    ctx.record("slot-pool path vs invariant path (same tokens)", paths)
    if ctx.cuda:
        ctx.record("peak GPU memory GiB", round(torch.cuda.max_memory_allocated() / 2**30, 2))

SECTIONS: dict[str, Callable[[Context], None]] = {
    "env": env, "tests": tests, "sgmv": sgmv, "exactness": exactness, "cycle": cycle, "sampler": sampler,
    "ranks": ranks, "bgmv": bgmv, "decode": decode,
}
