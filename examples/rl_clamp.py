"""RL on the seed's clamp exercise, written as a Tinker user would write it.

Each step: save sampler weights (a new policy version), sample a group of completions per prompt,
grade each in the sandbox against the five fixtures, centre rewards per group (constant-reward groups
carry no signal and are reported), build datums with the sampled logprobs and token-aligned advantages
(zero on prompt positions), and run ``importance_sampling`` + ``optim_step``. The forward_backward
returns the trainer's logprobs of the very tokens the sampler drew, so every step also reports the
sampler-trainer KL and max |dlogprob| (0.0 exactly when the invariant ops are on). Writes
``reward.png`` (reward and KL per step) and ``manifest.json`` (policy version of every trajectory).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

import lathe
from examples.clamp import grader, task
from examples.sft_clamp import receipt_dict


@dataclass(frozen=True, slots=True)
class RlConfig:
    base_model: str
    model_dir: Path
    out_dir: Path
    steps: int = 16
    prompts_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 40
    temperature: float = 0.7
    rank: int = 16
    learning_rate: float = 4e-4
    seed: int = 0


def rl_datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> lathe.Datum:
    tokens = prompt + completion
    n = len(prompt) - 1  # prompt positions among the targets: logprob 0, advantage 0
    return lathe.Datum(model_input=lathe.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:],
        "logprobs": [0.0] * n + list(logprobs),
        "advantages": [0.0] * n + [advantage] * len(completion),
    })


def pools_exact(receipts: list[lathe.Receipt | None]) -> bool:
    """Every receipt comes from a pool that passed its exactness self-check, all with one fingerprint."""
    return all(r is not None and r.exact for r in receipts) and len({r.fingerprint for r in receipts}) == 1


def sampler_trainer_gap(sampled: list[list[float]], out: lathe.ForwardBackwardOutput,
                        prompt_lens: list[int]) -> tuple[float, float]:
    """(KL estimate mean(q - p) over action tokens, max |q - p|) between sampler q and trainer p."""
    diffs = []
    for q, o, n in zip(sampled, out.loss_fn_outputs, prompt_lens, strict=True):
        p = o["logprobs"].to_numpy()[n - 1:]
        diffs.append(np.asarray(q, dtype=np.float64) - p.astype(np.float64))
    d = np.concatenate(diffs) if diffs else np.zeros(1)
    return float(d.mean()), float(np.abs(d).max())


def plot(path: Path, rewards: list[float], pass_rates: list[float], kls: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(rewards) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(steps, rewards, marker="o", label="mean reward (fixtures passed)")
    a.plot(steps, pass_rates, marker="s", label="all five pass")
    a.set_xlabel("step")
    a.set_ylim(-0.05, 1.05)
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, kls, marker="o", color="tab:red")
    b.set_xlabel("step")
    b.set_ylabel("sampler-trainer KL")
    b.grid(alpha=0.3)
    fig.suptitle("RL on clamp")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(sc: lathe.ServiceClient, cfg: RlConfig) -> dict:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(cfg.model_dir / "tokenizer.json"))
    tc = sc.create_lora_training_client(cfg.base_model, rank=cfg.rank, seed=cfg.seed)
    adam = lathe.AdamParams(learning_rate=cfg.learning_rate)
    params = lathe.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                  stop=["```", task.END_OF_TURN])
    rng = np.random.default_rng(cfg.seed)
    history, trajectories, receipts = [], [], []
    bar = tqdm(range(cfg.steps), desc="RL clamp", unit="step")
    for step in bar:
        t0 = time.monotonic()
        sampler = tc.save_weights_and_get_sampling_client(f"rl-step-{step}")
        prompts = [task.PROMPTS[i] for i in rng.choice(len(task.PROMPTS), cfg.prompts_per_step, replace=False)]
        rendered = [tok.encode(task.render_prompt(p), add_special_tokens=False).ids for p in prompts]
        futures = [sampler.sample(lathe.ModelInput.from_ints(r), cfg.group_size,
                                  lathe.SamplingParams(**{**asdict(params), "seed": int(rng.integers(2**31))}))
                   for r in rendered]
        groups = [f.result() for f in futures]
        texts = [[tok.decode(s.tokens, skip_special_tokens=False) for s in g.sequences] for g in groups]
        grades = grader.grade_many([grader.extract_function(t, task.PREFILL) for ts in texts for t in ts])
        data, sampled, plens, constant, flat = [], [], [], 0, []
        for gi, (prompt_ids, g) in enumerate(zip(rendered, groups, strict=True)):
            gr = grades[gi * cfg.group_size:(gi + 1) * cfg.group_size]
            rewards = [x.fraction for x in gr]
            if not grader.has_signal(rewards):
                constant += 1
            for s, adv, x, text in zip(g.sequences, grader.center(rewards), gr, texts[gi], strict=True):
                trajectories.append({"step": step, "policy_version": s.policy_version, "reward": x.fraction,
                                     "passed_all": x.reward, "error": x.error, "completion": text})
                flat.append((prompt_ids, s))
                if adv != 0.0:
                    data.append(rl_datum(prompt_ids, s.tokens, s.logprobs, adv))
                    sampled.append(s.logprobs)
                    plens.append(len(prompt_ids))
        mean_reward = float(np.mean([x.fraction for x in grades]))
        pass_rate = float(np.mean([x.reward for x in grades]))
        receipts += [receipt_dict(g.receipt) for g in groups]
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(adam)
            out = fb.result()
            receipts += [receipt_dict(out.receipt), receipt_dict(opt.result().receipt)]
        else:  # every group constant: nothing to train on, but the policy's logprobs are still compared
            data = [rl_datum(prompt_ids, s.tokens, s.logprobs, 0.0) for prompt_ids, s in flat]
            sampled, plens = [s.logprobs for _, s in flat], [len(prompt_ids) for prompt_ids, _ in flat]
            out = tc.forward(data, "importance_sampling").result()
            receipts.append(receipt_dict(out.receipt))
        kl, max_diff = sampler_trainer_gap(sampled, out, plens)
        exact = pools_exact([g.receipt for g in groups] + [out.receipt])
        history.append({"step": step, "reward": mean_reward, "pass_rate": pass_rate, "constant_groups": constant,
                        "sampler_trainer_kl": kl, "max_abs_dlogprob": max_diff, "pools_exact": exact,
                        "datums": len(data),
                        "sampler_path": sampler.model_path, "seconds": time.monotonic() - t0})
        bar.set_postfix(reward=f"{mean_reward:.2f}", pass_all=f"{pass_rate:.2f}")
        pools = ("exact" if exact else "NOT exact") + (f" ({out.receipt.dtype})" if out.receipt else "")
        tqdm.write(f"step {step + 1:3d}  reward {mean_reward:.3f}  pass {pass_rate:.3f}  constant groups "
                   f"{constant}/{len(groups)}  KL {kl:.2e}  max|dlp| {max_diff:.2e}  pools {pools}  "
                   f"sampler {sampler.model_path}")
    kls = [0.0 if math.isnan(h["sampler_trainer_kl"]) else h["sampler_trainer_kl"] for h in history]
    plot(cfg.out_dir / "reward.png", [h["reward"] for h in history], [h["pass_rate"] for h in history], kls)
    k = max(1, len(history) // 4)
    first = float(np.mean([h["reward"] for h in history[:k]]))
    last = float(np.mean([h["reward"] for h in history[-k:]]))
    manifest = {"model": cfg.base_model, "model_id": tc.model_id, "config": {**asdict(cfg), "model_dir": "",
                                                                              "out_dir": ""},
                "loss_fn": "importance_sampling", "optimizer": asdict(adam), "sampling": asdict(params),
                "reward_first_quarter": first, "reward_last_quarter": last, "steps": history,
                "trajectories": trajectories, "receipts": receipts}
    (cfg.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"RL: mean reward first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
          f"wrote {cfg.out_dir / 'reward.png'} and {cfg.out_dir / 'manifest.json'}")
    return manifest
