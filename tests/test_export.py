"""``lathe.export``: a Lathe adapter as a PEFT directory (loaded by ``peft``) and merged into a Hugging Face
model directory (loaded by ``transformers``) give the same logits, which the adapter changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lathe.export import METADATA, export_merged, export_peft
from lathe.models.config import ModelConfig
from lathe.models.lora import LoraSpec, LoraWeights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture
def checkpoint(tiny_dir: Path, tmp_path: Path) -> Path:
    """The files a trainer saves for a tiny-llama adapter with non-zero B (as after some training)."""
    spec = LoraSpec(rank=4, alpha=8.0)
    weights = LoraWeights.init(ModelConfig.from_dir(tiny_dir), spec, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for b in weights.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(weights.state_dict(), str(d / "adapter_model.safetensors"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "lathe/tiny-llama", "r": 4,
        "lora_alpha": 8.0, "lora_dropout": 0.0, "bias": "none", "target_modules": targets, "fan_in_fan_out": False,
        "inference_mode": True}))
    return d


def test_peft_and_merged_exports_give_the_same_logits(checkpoint: Path, tiny_dir: Path, tmp_path: Path) -> None:
    tokens = torch.tensor([[1, 17, 99, 250, 3, 42, 7, 300]])
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
    peft_dir = export_peft(checkpoint, tmp_path / "peft", base_dir=tiny_dir, tinker_path="tinker://r:train:0/weights/x")
    adapted = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        export_merged(checkpoint, tmp_path / "merged", base_dir=tiny_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        peft_logits, merged_logits = adapted(tokens).logits, merged(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=0)
    meta = json.loads((peft_dir / METADATA).read_text())
    assert (meta["rank"], meta["alpha"], meta["tinker_path"]) == (4, 8.0, "tinker://r:train:0/weights/x")
