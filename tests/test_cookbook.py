"""tinker-cookbook 0.6.1's offline recipes, unchanged, against Lathe's HTTP door with a local tiny model directory
and the role_colon renderer: supervised learning on the bundled conversations, then RL on the arithmetic env
(the math_rl command line with its default loss, and the RL trainer with a KL penalty) starting from the
supervised checkpoint.

Each recipe runs in its own process, as a user would run it, and is judged by the metrics it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lathe.stack import Stack

RECIPE_TIMEOUT_S = 240
COOKBOOK_KEY = "tml-cookbook"
KL_PROMPTS = [f"User: What is {a} + {b}?\n\nAssistant:" for a, b in ((3, 4), (12, 9), (7, 30), (41, 5), (6, 66))]

SUPERVISED = """
import asyncio, sys
from importlib import resources
import tinker
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

# the recipe asks for an adapter without a seed (so a random one); this run's is seeded, so it starts alike every time
unseeded = tinker.ServiceClient.create_lora_training_client
tinker.ServiceClient.create_lora_training_client = lambda self, *a, seed=None, **k: unseeded(
    self, *a, seed=0 if seed is None else seed, **k)
url, model, log = sys.argv[1:]
data = str(resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl")
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon", max_length=256,
                                        batch_size=8, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
asyncio.run(train.main(train.Config(
    log_path=log, model_name=model, recipe_name="lathe_sl", renderer_name="role_colon", base_url=url,
    dataset_builder=FromConversationFileBuilder(common_config=common, file_path=data), learning_rate=5e-3,
    lr_schedule="constant", lora_rank=8, save_every=0, eval_every=0, max_steps=6)))
"""

RL_WITH_KL = """
import asyncio, itertools, sys
import tinker
from tinker_cookbook.recipes.math_rl.train import get_dataset_builder
from tinker_cookbook.rl import train

# The recipe samples unseeded; each of its samples gets the next seed of a counter instead, in the order the recipe
# asks for them (its tasks start in a fixed order), so the run, and the KL it ends at, is the same every time.
seeds, unseeded = itertools.count(1), tinker.SamplingClient.sample
tinker.SamplingClient.sample = lambda self, prompt, num_samples, sampling_params, *a, **k: unseeded(
    self, prompt, num_samples, sampling_params if sampling_params.seed is not None else
    sampling_params.model_copy(update={"seed": next(seeds)}), *a, **k)
url, model, log, start = sys.argv[1:]
asyncio.run(train.main(train.Config(
    log_path=log, model_name=model, recipe_name="lathe_rl_kl", renderer_name="role_colon", base_url=url,
    dataset_builder=get_dataset_builder(env="arithmetic", batch_size=8, model_name=model, renderer_name="role_colon",
                                        group_size=2),
    learning_rate=5e-3, lora_rank=8, max_tokens=5, loss_fn="importance_sampling", load_checkpoint_path=start,
    kl_penalty_coef=1.0, kl_reference_config=train.KLReferenceConfig(base_model=model),
    eval_every=0, save_every=0, max_steps=4)))
"""


DOWNLOAD = """
import sys
from tinker_cookbook import weights

weights.download(tinker_path=sys.argv[1], output_dir=sys.argv[2], base_url=sys.argv[3])
"""


ASYNC_RL = """
import asyncio, sys
from tinker_cookbook.recipes.math_rl import arithmetic_env
from tinker_cookbook.recipes.math_rl.train import get_dataset_builder
from tinker_cookbook.rl import train

arithmetic_env.ArithmeticEnv.check_answer = lambda self, text: "e" in text
url, model, log, steps = sys.argv[1:]
asyncio.run(train.main(train.Config(
    log_path=log, model_name=model, recipe_name="lathe_async_rl", renderer_name="role_colon", base_url=url,
    dataset_builder=get_dataset_builder(env="arithmetic", batch_size=4, model_name=model, renderer_name="role_colon",
                                        group_size=4),
    learning_rate=2e-2, lora_rank=8, max_tokens=5, eval_every=0, save_every=0, max_steps=int(steps),
    async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=4))))
"""


def run(args: list[str], log: Path | None) -> list[dict]:
    """Run a recipe process (offline, bounded) and return the metrics it logged (under ``log``), one dict per
    step."""
    env = {**os.environ, "TINKER_API_KEY": COOKBOOK_KEY, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=RECIPE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [] if log is None else [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def _kl_to_base(stack: Stack, tiny_dir: Path, workdir: Path, path: str) -> float:
    """The mean over every position of ``KL_PROMPTS`` of KL(model || base) of the next-token distributions, exact
    (over the whole vocabulary), for the training state at ``path`` merged into the base model."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from lathe.export import export_merged

    # downloaded by a process of its own, as a user would: the tinker SDK keeps one REST client per base URL for the
    # life of a process, with the API key it found first (another module's, in this one)
    adapter = workdir / "adapter"
    run(["-c", DOWNLOAD, path, str(adapter), stack.http_url], None)
    merged = export_merged(adapter, workdir / "merged", base_dir=tiny_dir)
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in KL_PROMPTS]
    with torch.no_grad():
        logp = [torch.cat([AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(torch.tensor([t])).logits[0]
                           for t in ids]).log_softmax(-1) for d in (merged, tiny_dir)]
    return float((logp[0].exp() * (logp[0] - logp[1])).sum(-1).mean())


def final_state(log: Path) -> str:
    """The training-state path of the recipe's final checkpoint."""
    rows = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    return next(r["state_path"] for r in rows if r["name"] == "final")


@pytest.fixture(scope="module")
def supervised(stack: Stack, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    log = tmp_path_factory.mktemp("sl")
    return run(["-c", SUPERVISED, stack.http_url, str(tiny_dir), str(log)], log), final_state(log)


def test_supervised_recipe_on_bundled_conversations_lowers_the_nll(supervised: tuple[list[dict], str]) -> None:
    metrics, state = supervised
    nll = [m["train_mean_nll"] for m in metrics]
    assert len(nll) == 6
    assert nll[-1] < nll[0] - 0.5, nll
    assert state.startswith("tinker://") and state.endswith("/weights/final")


def test_math_rl_arithmetic_recipe_trains_on_policy_with_its_default_loss(
        stack: Stack, tiny_dir: Path, supervised: tuple[list[dict], str], tmp_path: Path) -> None:
    """The command line's default loss is ``stable_reinforce``: samples recorded with ``record_stability_info``,
    datums that name them (provenance)."""
    metrics = run(["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={tiny_dir}",
                   "renderer_name=role_colon", f"base_url={stack.http_url}",
                   "group_size=2", "groups_per_batch=4", "max_tokens=5", "max_steps=2", "eval_every=0", "save_every=0",
                   "lora_rank=8", f"load_checkpoint_path={supervised[1]}", f"log_path={tmp_path}",
                   "behavior_if_log_dir_exists=delete"], tmp_path)
    steps = [m for m in metrics if "step:max" in m]
    assert [m["step:max"] for m in steps] == [1.0, 2.0]  # the server applied one optimizer step per RL step
    for m in steps:
        assert m["tokens/trained"] > 0
        assert m["optim/kl_sample_train_v1"] == 0.0  # the sampler's logprobs are the trainer's, bit for bit
    assert final_state(tmp_path).endswith("/weights/final")
    assert json.loads((tmp_path / "config.json").read_text())["loss_fn"] == "stable_reinforce"


def test_async_rl_with_stable_reinforce_trains_off_policy_on_the_recorded_samples(
        stack: Stack, tiny_dir: Path, tmp_path: Path) -> None:
    """The cookbook's async RL loop unchanged (``AsyncConfig(max_steps_off_policy=1)``: sampling runs a step ahead of
    training) with its async default loss, stable_reinforce: samples recorded with ``record_stability_info``, datums
    resolved against the records. A step trained on samples of the weights it trains has a sampler-trainer KL of
    exactly 0; one whose samples came from weights an earlier step has since moved does not (the records are the
    behaviour policy's). The arithmetic task's answers are out of the tiny model's reach, so the reward is whether
    the answer holds an "e": easy to learn (``ASYNC_RL``)."""
    metrics = run(["-c", ASYNC_RL, stack.http_url, str(tiny_dir), str(tmp_path), "5"], tmp_path)
    steps = [m for m in metrics if "optim/kl_sample_train_v1" in m]
    assert len(steps) == 5 and max(m["async/staleness_max"] for m in steps) >= 1  # it ran off policy
    moved = False
    for m in steps:
        if m["async/staleness_max"] == 0 or not moved:  # sampled from the weights being trained
            assert m["optim/kl_sample_train_v1"] == 0.0, m
        elif m["async/staleness_min"] >= 1:  # sampled from weights that the optimizer has since moved
            assert m["optim/kl_sample_train_v1"] != 0.0, m
        moved = moved or m["grad_norm:mean"] > 0


def test_rl_with_a_kl_penalty_pulls_the_policy_back_toward_the_base(stack: Stack, tiny_dir: Path,
                                                                    supervised: tuple[list[dict], str],
                                                                    tmp_path: Path) -> None:
    """From the supervised checkpoint the policy differs from the base model, so the KL penalty gives every
    token an advantage: gradients flow, and the policy ends nearer the base. Both recipes run seeded (the adapter's
    initialization, each sample's seed from a counter), so the run is the same every time. Nearer is measured
    without sampling: the exact KL of the next-token distributions to the base's over every position of fixed
    arithmetic prompts, from the start and the final checkpoints, each downloaded and merged as a user would."""
    metrics = run(["-c", RL_WITH_KL, stack.http_url, str(tiny_dir), str(tmp_path), supervised[1]], tmp_path)
    assert len([m for m in metrics if "kl_policy_base" in m]) == 4  # the recipe measured it every step
    assert all(m["grad_norm:mean"] > 0 for m in metrics if "grad_norm:mean" in m)
    start, final = (_kl_to_base(stack, tiny_dir, tmp_path / name, path)
                    for name, path in (("start", supervised[1]), ("final", final_state(tmp_path))))
    print(f"KL to base: start {start:.5f}, final {final:.5f}")
    assert 0 < final < start, (start, final)
