"""tinker-cookbook 0.6.1's DPO recipe (``preference.train_dpo``), unchanged, against Lathe's HTTP door on a local
preference file and the tiny model with the role_colon renderer. The recipe takes its reference from the initial
weights (``save_weights_and_get_sampling_client``), scores pairs with ``compute_logprobs`` and trains with
``forward_backward_custom``; it runs in its own process, as a user would run it, and is judged by its metrics."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lathe.stack import Stack

RECIPE_TIMEOUT_S = 300
STEPS = 4

DPO = """
import sys
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

url, model, log, data, steps = sys.argv[1:]
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon", max_length=128,
                                        batch_size=4)
train_dpo.main(train_dpo.Config(
    log_path=log, model_name=model, recipe_name="lathe_dpo", renderer_name="role_colon", base_url=url,
    dataset_builder=DPODatasetBuilderFromComparisons(common_config=common,
                                                     comparison_builder=ComparisonBuilderFromJsonl(train_path=data)),
    learning_rate=2e-2, lr_schedule="constant", dpo_beta=0.5, lora_rank=8, num_epochs=int(steps),
    save_every=0, eval_every=0, max_steps=int(steps)))
"""


def preferences(path: Path) -> Path:
    """Four comparisons in the shape the recipe's JSONL builder reads: the chosen answer is the right sum, the
    rejected one a wrong number, alternating which side (A or B) is preferred."""
    rows = []
    for i, (a, b) in enumerate([(2, 3), (4, 1), (6, 2), (3, 5)]):
        good = {"role": "assistant", "content": f"The answer is {a + b}."}
        bad = {"role": "assistant", "content": f"The answer is {a * b + 7}."}
        first, second, label = (good, bad, "A") if i % 2 == 0 else (bad, good, "B")
        rows.append({"comparison": {"prompt_conversation": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                    "completion_A": [first], "completion_B": [second]}, "label": label})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dpo_recipe_on_local_preferences_widens_the_margin(stack: Stack, tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    log, data = tmp_path / "log", preferences(tmp_path / "prefs.jsonl")
    env = {**os.environ, "TINKER_API_KEY": "tml-dpo", "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DPO, stack.http_url, str(tiny_dir), str(log), str(data), str(STEPS)],
                          env=env, capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in metrics if "dpo_loss" in m]
    assert len(rows) == STEPS, metrics
    for m in rows:
        assert all(math.isfinite(m[k]) for k in ("dpo_loss", "margin", "accuracy", "chosen_reward",
                                                  "rejected_reward")), m
    # the first step starts at the reference (log ratios 0: loss log 2, margin 0); training prefers the chosen
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3) and abs(rows[0]["margin"]) < 1e-3
    assert rows[-1]["margin"] > 0.05 and rows[-1]["dpo_loss"] < math.log(2) - 0.01, rows
    assert rows[-1]["accuracy"] == 1.0, rows
