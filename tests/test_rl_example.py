"""The RL half of `make demo` (examples/rl_clamp.py) on the tiny model through real processes: every step
compares the sampler's logprobs with the trainer's (also a step with nothing to train on) and finds them
bitwise equal, from pools that passed their self-checks with one fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import lathe
from examples import rl_clamp
from lathe.stack import Stack


def test_every_rl_step_reports_zero_kl_from_exact_pools(stack: Stack, tiny_dir: Path, tmp_path: Path) -> None:
    cfg = rl_clamp.RlConfig(base_model="lathe/tiny-llama", model_dir=tiny_dir, out_dir=tmp_path / "rl", steps=2,
                            prompts_per_step=2, group_size=2, max_tokens=8, rank=4)
    with lathe.ServiceClient(base_url=stack.gateway, api_key="tml-rl-example") as sc:
        manifest = rl_clamp.run(sc, cfg)
    history = manifest["steps"]
    assert len(history) == 2
    for h in history:
        assert h["sampler_trainer_kl"] == 0.0 and h["max_abs_dlogprob"] == 0.0, h
        assert h["pools_exact"] is True, h
    receipts = json.loads((tmp_path / "rl" / "manifest.json").read_text())["receipts"]
    assert {r["op"] for r in receipts} >= {"sample"} and all(r["exact"] for r in receipts)
    assert len({r["fingerprint"] for r in receipts}) == 1
