"""SFT step: Lathe through SDK -> gateway -> trainer, the trainer engine in-process, and transformers + peft.

    python bench/bench_sft.py [--model smollm2|tiny] [--batch 8] [--seq 256] [--rank 32] [--steps 3] [--bf16]

Each contender runs in its own child process (so each peak RSS is its own) on the same random batch:
``batch`` sequences of ``seq`` tokens, LoRA rank ``rank`` on q/k/v/o/gate/up/down, AdamW, fp32. A step
is forward + backward + optimizer step. Prints the median step time, tokens/s and peak RSS of each,
and the ratios the issue asks for: service / in-process (overhead), transformers / Lathe (speed),
Lathe / transformers (peak memory). The trainer runs with the allocator settings the stack gives its pools
(``lathe.stack.POOL_MALLOC``); transformers + peft runs as a user would, and once more with the same settings.
With ``--bf16`` two more: Lathe's trainer pool in bf16 (base weights and activations bf16, LoRA and AdamW fp32)
through the services, and transformers + peft under ``torch.autocast("cpu", dtype=torch.bfloat16)``; the ratios
printed are the issue's bf16 rows (against transformers + peft fp32, and under autocast).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_dir(name: str) -> tuple[str, Path]:
    if name == "tiny":
        from lathe.models.tiny import ensure_tiny_model

        return "lathe/tiny-llama", ensure_tiny_model(CACHE)
    from lathe.models.catalog import SMOLLM2
    from lathe.models.smollm2 import import_smollm2

    return SMOLLM2, import_smollm2(CACHE)


def batch_tokens(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(args.seq + 1)] for _ in range(args.batch)]


def run_hf(args: argparse.Namespace) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, path = model_dir(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
    toks = torch.tensor(batch_tokens(args, model.config.vocab_size))
    times = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            out = model(input_ids=toks[:, :-1], labels=toks[:, :-1])  # transformers shifts the labels itself
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return times[1:]


def _data(args: argparse.Namespace, vocab: int):  # noqa: ANN202 - list of lathe.Datum
    import lathe

    return [lathe.Datum(model_input=lathe.ModelInput.from_ints(t[:-1]),
                        loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
            for t in batch_tokens(args, vocab)]


def run_engine(args: argparse.Namespace) -> list[float]:
    from lathe.models.catalog import ModelCatalog
    from lathe.trainer import intake
    from lathe.trainer.engine import TrainerConfig, TrainerEngine
    from lathe.v1 import lathe_pb2 as pb
    from lathe.wire import datum_to_proto

    name, _ = model_dir(args.model)
    eng = TrainerEngine(TrainerConfig(models=name, cache_root=CACHE, activation_checkpointing=args.ckpt),
                        ModelCatalog.from_spec(name, CACHE))
    eng.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=name, lora_config=pb.LoraConfig(
        rank=args.rank, train_attn=True, train_mlp=True, train_unembed=False)))
    data = [datum_to_proto(d) for d in _data(args, eng.base(name).cfg.vocab_size)]
    eng.start()
    fb = pb.ForwardBackwardRequest(model_id="m", data=data, loss_fn="cross_entropy")
    adam = pb.OptimStepRequest(model_id="m", adam_params=pb.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95,
                                                                      eps=1e-12))
    times = []
    for k in range(args.steps + 1):
        t = time.perf_counter()
        f1 = intake.submit(eng, pb.TrainerOp(model_id="m", seq_id=2 * k + 1, tenant="t", forward_backward=fb))
        f2 = intake.submit(eng, pb.TrainerOp(model_id="m", seq_id=2 * k + 2, tenant="t", optim_step=adam))
        f1.result()
        f2.result()
        times.append(time.perf_counter() - t)
    eng.stop()
    return times[1:]


def run_service(args: argparse.Namespace) -> tuple[list[float], int]:
    import lathe
    from lathe.stack import Stack, StackConfig

    name, path = model_dir(args.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    data = _data(args, vocab)
    cfg = StackConfig(models=name, store_root=CACHE / "bench-store", cache_root=CACHE, trainer_threads=args.threads,
                      sampler_threads=1, trainer_dtype=args.dtype,
                      trainer_args=("--activation-checkpointing",) if args.ckpt else ())
    with Stack(cfg) as stack, lathe.ServiceClient(base_url=stack.gateway, api_key="tml-bench") as sc:
        tc = sc.create_lora_training_client(name, rank=args.rank, train_unembed=False)
        times = []
        for _ in range(args.steps + 1):
            t = time.perf_counter()
            f1, f2 = tc.forward_backward(data, "cross_entropy"), tc.optim_step(lathe.AdamParams())
            f1.result()
            f2.result()
            times.append(time.perf_counter() - t)
        trainer = next(s for s in stack.services if s.name == "trainer")
        status = Path(f"/proc/{trainer.proc.pid}/status").read_text()
        hwm_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    return times[1:], hwm_kb * 1024


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.mode == "service":
        times, peak = run_service(args)
    else:
        times = run_hf(args) if args.mode == "hf" else run_engine(args)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"times": times, "peak": peak}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="also Lathe in bf16 and transformers + peft under autocast")
    ap.add_argument("--mode", choices=["hf", "engine", "service"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        child(args)
        return
    model_dir(args.model)  # import once, outside the timed children
    from lathe.stack import POOL_MALLOC

    res = {}
    pool = {"GLIBC_TUNABLES": POOL_MALLOC}  # the stack gives its pools these; the in-process engine gets them too
    bf16 = ["--dtype", "bfloat16"]
    contenders = [("service", "service", [], {}), ("engine", "engine", [], pool),
                  ("service+ckpt", "service", ["--ckpt"], {}), ("hf", "hf", [], {}), ("hf+malloc", "hf", [], pool)]
    if args.bf16:
        contenders += [("service-bf16", "service", bf16, {}), ("hf-autocast", "hf", bf16, {})]
    for key, mode, extra, env in contenders:
        cmd = [sys.executable, __file__, "--mode", mode, *extra, *sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, **env}).stdout.strip().splitlines()[-1]
        res[key] = json.loads(out)
    tokens = args.batch * args.seq
    print(f"SFT step, {args.model}, {args.batch}x{args.seq} tokens, LoRA rank {args.rank} on 7 targets, "
          f"{args.threads} threads, median of {args.steps} steps")
    print(f"{'contender':<34}{'step s':>9}{'tokens/s':>10}{'peak RSS GB':>13}")
    labels = {"service": "Lathe SDK -> gateway -> trainer", "engine": "Lathe trainer engine in-process",
              "service+ckpt": "  same, activation checkpointing", "hf": "transformers + peft",
              "hf+malloc": "  same, the pools' allocator settings", "service-bf16": "Lathe SDK -> trainer, bf16 pool",
              "hf-autocast": "transformers + peft, bf16 autocast"}
    med = {m: statistics.median(r["times"]) for m, r in res.items()}
    for mode, r in res.items():
        print(f"{labels[mode]:<34}{med[mode]:>9.3f}{tokens / med[mode]:>10.0f}{r['peak'] / 1e9:>13.2f}")
    print(f"overhead service / in-process: {med['service'] / med['engine']:.3f}  (target <= 1.05)")
    print(f"speed transformers / Lathe:    {med['hf'] / med['service']:.2f}x  (target >= 1)")
    for key in ("service", "service+ckpt"):
        print(f"peak memory Lathe trainer ({key}) / transformers: {res[key]['peak'] / res['hf']['peak']:.2f}  "
              "(target <= 0.5)")
    print(f"speed transformers / Lathe with activation checkpointing: {med['hf'] / med['service+ckpt']:.2f}x")
    print(f"speed transformers with the pools' allocator settings / Lathe: {med['hf+malloc'] / med['service']:.2f}x")
    if args.bf16:
        print(f"speed transformers fp32 / Lathe bf16:          {med['hf'] / med['service-bf16']:.2f}x  (target >= 3)")
        print(f"speed transformers autocast bf16 / Lathe bf16: {med['hf-autocast'] / med['service-bf16']:.2f}x  "
              "(target >= 1.5)")


if __name__ == "__main__":
    main()
