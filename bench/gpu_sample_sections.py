"""The sampling-side sections of ``bench/gpu_check.py``, each recording into a ``Context``:

    sampler    64 sequences over 8 adapters: the sampler's steps vs transformers + peft ``generate``, and the
               sampler-trainer KL (the sampled tokens' logprobs recomputed by the trainer's forward)
    bgmv       BGMV at a decode step's shape (the slot pool's path): Triton vs the torch reference, GB/s vs a copy
    decode     paged-KV decode attention; decode tokens/s with CUDA graphs on vs off; the slot-pool (BGMV,
               throughput) decode path vs the invariant per-segment path: tokens/s and logprob differences

The sampler's adapters are in ``--dtype``. These sections drive the sampler's compute (``sampler.step.run_step``,
``DecodeRunner``) without the engine's queues and threads, which need the generated protobuf code.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from gpu_context import Context, example, gpu_variants, median_s, random_adapters, random_model, random_tokens, sync

from lathe.kernels import attention as attn
from lathe.kernels.sgmv_triton import triton_available
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraWeights
from lathe.models.pool import DTYPES
from lathe.sampler.adapters import adapter_dtype, load_adapter
from lathe.sampler.blocks import blocks_for
from lathe.sampler.graphs import DecodeRunner, GraphConfig
from lathe.sampler.kv import KVPool, StepKV
from lathe.sampler.sampling import Rule, choose
from lathe.sampler.slots import SlotPool
from lathe.sampler.step import Item, ItemOut, run_step
from lathe.trainer.bank import Adapter
from lathe.trainer.optimizer import AdamState
from lathe.trainer.step import Job, run_jobs

BASE = "gpu-check/random-llama"


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
