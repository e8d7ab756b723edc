"""Supervised fine-tuning on the seed's clamp task, written as a Tinker user would write it.

A plain loop over the SDK: build datums (prompt positions weight 0, answer positions weight 1),
``forward_backward`` -> ``optim_step`` per step, then ``save_state`` and ``save_weights_for_sampler``.
Writes ``loss.png`` and ``manifest.json`` (model, tokenizer, rank, loss and optimizer config,
checkpoint paths, and every step's receipts) into the run directory.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer
from tqdm import tqdm

import lathe
from examples.clamp import task


@dataclass(frozen=True, slots=True)
class SftConfig:
    base_model: str
    model_dir: Path
    out_dir: Path
    steps: int = 20
    batch_size: int = 8
    rank: int = 16
    learning_rate: float = 3e-4
    seed: int = 0


def build_datum(tok: Tokenizer, prompt: str, completion: str) -> lathe.Datum:
    """Input = tokens[:-1], target = tokens[1:], weight 1 only where the target is an answer token."""
    p = tok.encode(prompt, add_special_tokens=False).ids
    c = tok.encode(completion, add_special_tokens=False).ids
    tokens = p + c
    weights = [0.0] * (len(p) - 1) + [1.0] * len(c)
    return lathe.Datum(model_input=lathe.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def receipt_dict(r: lathe.Receipt | None) -> dict:
    return {} if r is None else asdict(r)


def plot(path: Path, ys: list[float], title: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(ys) + 1), ys, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(sc: lathe.ServiceClient, cfg: SftConfig) -> dict:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(cfg.model_dir / "tokenizer.json"))
    examples = task.sft_examples(cfg.steps * cfg.batch_size, cfg.seed)
    tc = sc.create_lora_training_client(cfg.base_model, rank=cfg.rank, seed=cfg.seed)
    adam = lathe.AdamParams(learning_rate=cfg.learning_rate)
    losses, receipts = [], []
    bar = tqdm(range(cfg.steps), desc="SFT clamp", unit="step")
    for step in bar:
        chunk = examples[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        data = [build_datum(tok, p, c) for p, c in chunk]
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        out, opt_out = fb.result(), opt.result()
        tokens = sum(float(sum(d.loss_fn_inputs["weights"].tolist())) for d in data)
        loss = out.metrics["loss:sum"] / tokens
        losses.append(loss)
        receipts += [receipt_dict(out.receipt), receipt_dict(opt_out.receipt)]
        bar.set_postfix(loss=f"{loss:.4f}")
        tqdm.write(f"step {step + 1:3d}  loss/token {loss:.4f}  cycle {out.receipt.cycle if out.receipt else '-'}")
    state = tc.save_state("sft-final").result().path
    sampler = tc.save_weights_for_sampler("sft-final").result().path
    plot(cfg.out_dir / "loss.png", losses, f"SFT on clamp: {cfg.base_model}", "loss per answer token")
    tok_bytes = (cfg.model_dir / "tokenizer.json").read_bytes()
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": cfg.base_model,
        "model_id": tc.model_id,
        "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(tok_bytes).hexdigest()},
        "renderer": "chatml (SmolLM2 chat template) + python fence prefill",
        "lora": {"rank": cfg.rank, "alpha": 32.0, "seed": cfg.seed},
        "loss_fn": "cross_entropy",
        "optimizer": asdict(adam),
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "loss_per_token": losses,
        "checkpoints": {"state": state, "sampler_weights": sampler},
        "receipts": receipts,
    }
    (cfg.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"SFT: loss/token {losses[0]:.4f} -> {losses[-1]:.4f}; state {state}; sampler {sampler}")
    print(f"SFT: wrote {cfg.out_dir / 'loss.png'} and {cfg.out_dir / 'manifest.json'}")
    return manifest
