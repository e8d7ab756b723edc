"""The RL half of `make demo` (examples/rl_clamp.py) on the tiny model through real processes: every step
compares the sampler's logprobs with the trainer's (also a step with nothing to train on) and finds them
bitwise equal, from pools that passed their self-checks with one fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lathe
from examples import rl_clamp
from lathe.models.tiny import ensure_tiny_model
from lathe.stack import Stack


@pytest.mark.parametrize("base", ["lathe/tiny-llama", "lathe/tiny-qwen3-moe"])
def test_every_rl_step_reports_zero_kl_from_exact_pools(stack: Stack, model_cache: Path, tmp_path: Path,
                                                        base: str) -> None:
    """On the dense tiny model and on the tiny Qwen3-MoE (whose routing then is the same in both pools)."""
    model_dir = ensure_tiny_model(model_cache, "llama" if base == "lathe/tiny-llama" else "qwen3_moe")
    cfg = rl_clamp.RlConfig(base_model=base, model_dir=model_dir, out_dir=tmp_path / "rl", steps=2,
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
