"""Cost per token of a mixture-of-experts model against dense models of its active and of its total parameters.

    python bench/bench_moe.py [--tokens 1024] [--length 128] [--repeats 5] [--threads 2]

Three generated Qwen3-family models, one shape but the MLP (hidden 256, 4 layers, 8 heads of 64, 2 KV heads,
vocabulary 512, random weights), run side by side in this process:
- ``moe``: Qwen3-MoE, 16 experts of width 256, top 2 (the layout of Qwen3-30B-A3B, scaled down);
- ``dense-active``: one MLP of width 512 = k x expert width: the MoE's active parameters per token;
- ``dense-total``: one MLP of width 4096 = E x expert width: its total parameters.
Each runs what a trainer pool runs for one cross-entropy job (``lathe.trainer.step.run_jobs``: the packed pass on
the batch-invariant ops, forward and backward, a rank-8 LoRA on every target, each expert's included), and a
forward alone (what a sampler's prefill costs), over ``--tokens`` tokens in sequences of ``--length``; models
alternate, median of ``--repeats``. Printed: milliseconds per token, the MoE's ratio to each dense model (the
hosted anchor: Tinker's Qwen3-30B-A3B pool ran 3.3x slower per cycle than a dense 4B one at the same batch), and
each figure against the arithmetic floor: its linear layers' FLOPs at this machine's GEMM rate (``gemm_gflops``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import cpu_line, gemm_gflops
from tqdm import tqdm

from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights, module_shape
from lathe.models.tiny import write_tiny_model
from lathe.trainer.ops import Example
from lathe.trainer.step import Job, run_jobs

SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 2048}
EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 256
MODELS = {
    "moe": ("qwen3_moe", {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_WIDTH}),
    "dense-active": ("qwen3", {"intermediate_size": TOP_K * EXPERT_WIDTH}),
    "dense-total": ("qwen3", {"intermediate_size": EXPERTS * EXPERT_WIDTH}),
}


def build(root: Path, name: str) -> Decoder:
    arch, mlp = MODELS[name]
    d = write_tiny_model(root / name, arch, seed=1, hidden_size=SHAPE["hidden_size"],
                         num_hidden_layers=SHAPE["num_hidden_layers"], num_attention_heads=SHAPE["num_attention_heads"],
                         num_key_value_heads=SHAPE["num_key_value_heads"], head_dim=SHAPE["head_dim"],
                         max_position_embeddings=SHAPE["max_position_embeddings"], overrides=mlp)
    return Decoder.from_dir(d)


def active_linear_flops(model: Decoder) -> int:
    """Multiply-adds x 2 of one token's base linears (attention, the MLP or its k experts and router, the LM head)."""
    cfg = model.cfg
    per_layer = 0
    for i in range(cfg.num_layers):
        per_layer += sum(a * b for a, b in (module_shape(cfg, t) for t in ("q_proj", "k_proj", "v_proj", "o_proj")))
        if cfg.sparse(i):
            per_layer += cfg.experts_per_token * 3 * cfg.hidden_size * cfg.moe_intermediate_size
            per_layer += cfg.num_experts * cfg.hidden_size
        else:
            per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * (per_layer + cfg.hidden_size * cfg.vocab_size)


def examples(vocab: int, tokens: int, length: int) -> list[Example]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(tokens // length):
        toks = torch.randint(3, vocab, (length + 1,), generator=gen)
        out.append(Example(toks[:-1].tolist(), toks[1:].clone(), {"weights": torch.ones(length)}))
    return out


def timed(model: Decoder, adapter: LoraWeights, data: list[Example], backward: bool) -> float:
    start = time.perf_counter()
    (res,) = run_jobs(model, [Job(adapter, data, "cross_entropy", {}, backward=backward)])
    if res.error is not None:
        raise RuntimeError(res.error)
    seconds = time.perf_counter() - start
    for p in adapter.parameters():
        p.grad = None
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()}; torch {torch.__version__}, {args.threads} threads, fp32, invariant ops")
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: build(Path(tmp), name) for name in MODELS}
    adapters = {n: LoraWeights.init(m.cfg, LoraSpec(rank=8), seed=2) for n, m in models.items()}
    data = {n: examples(m.cfg.vocab_size, args.tokens, args.length) for n, m in models.items()}
    times: dict[tuple[str, bool], list[float]] = {(n, b): [] for n in models for b in (False, True)}
    for name, model in models.items():  # warm: the first pass pays one-time costs
        timed(model, adapters[name], data[name][:1], True)
    for _ in tqdm(range(args.repeats), desc="rounds", unit="round"):
        for name, model in models.items():
            for backward in (False, True):
                times[(name, backward)].append(timed(model, adapters[name], data[name], backward))
    rate = gemm_gflops(args.threads) * 1e9
    tokens = len(data["moe"]) * args.length
    print(f"\n{tokens} tokens a pass, sequences of {args.length}; GEMM rate {rate / 1e9:.1f} GFLOP/s\n")
    print("| model | total params | active linear MFLOP/token | forward ms/token | forward+backward ms/token "
          "| floor ms/token (fwd+bwd) | x floor |")
    print("|---|---|---|---|---|---|---|")
    per_token = {}
    for name, model in models.items():
        fwd = statistics.median(times[(name, False)]) / tokens * 1e3
        both = statistics.median(times[(name, True)]) / tokens * 1e3
        per_token[name] = (fwd, both)
        flops = active_linear_flops(model)
        floor = 2 * flops / rate * 1e3  # backward of a frozen linear: the input's gradient, as many FLOPs again
        total = sum(t.numel() for t in model.w.values())
        print(f"| {name} | {total / 1e6:.1f} M | {flops / 1e6:.2f} | {fwd:.3f} | {both:.3f} | {floor:.4f} "
              f"| {both / floor:.1f} |")
    moe = per_token["moe"]
    for other in ("dense-active", "dense-total"):
        ref = per_token[other]
        print(f"moe / {other}: forward {moe[0] / ref[0]:.2f}x, forward+backward {moe[1] / ref[1]:.2f}x")
    print("hosted anchor: Qwen3-30B-A3B / dense 4B on Tinker, 3.3x per cycle at the same batch")


if __name__ == "__main__":
    main()
