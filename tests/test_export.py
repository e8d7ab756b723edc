"""``lathe.export``: a Lathe adapter as a PEFT directory (loaded by ``peft``) and merged into a Hugging Face
model directory (loaded by ``transformers``) give the same logits, which the adapter changes, and the logprobs of
Lathe's own trainer after training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lathe.export import METADATA, export_merged, export_peft
from lathe.models.config import ModelConfig
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.v1 import lathe_pb2 as pb

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


class _MemoryStore:
    """The trainer's checkpoint store in memory: what a save writes, by path."""

    def __init__(self) -> None:
        self.saved: dict[str, dict[str, bytes]] = {}

    def put(self, *, tenant: str, run_id: str, kind: str, name: str, files: dict[str, bytes], metadata_json: str,
            ttl_seconds: int, overwrite: bool, max_tenant_bytes: int = 0) -> str:
        path = f"tinker://{run_id}/{kind}/{name}"
        self.saved[path] = files
        return path

    def get(self, *, tenant: str, path: str) -> dict[str, bytes]:
        return self.saved[path]


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("base", ["lathe/tiny-llama", "lathe/tiny-qwen3-moe"])
def test_exports_reproduce_lathes_own_logprobs(model_cache: Path, tmp_path: Path, base: str) -> None:
    """Train a few steps in Lathe's trainer, read its logprobs from a forward, save the adapter as the trainer does,
    export it: ``peft`` on the transformers base model and the merged model in ``transformers`` give Lathe's
    logprobs within 1e-5 (and the training moved them). On the tiny Qwen3-MoE the adapter holds an A/B pair per
    expert under PEFT's per-expert names, which peft folds into transformers' fused expert tensors on load."""
    from lathe.models.catalog import ModelCatalog
    from lathe.models.tiny import ensure_tiny_model
    from lathe.trainer.engine import TrainerConfig, TrainerEngine
    from tests.helpers import pb_datum
    from tests.test_trainer_engine import fb, opt, submit

    tiny_dir = ensure_tiny_model(model_cache, "llama" if base == "lathe/tiny-llama" else "qwen3_moe")
    store = _MemoryStore()
    engine = TrainerEngine(TrainerConfig(models=base, cache_root=model_cache),
                           ModelCatalog.from_spec(base, model_cache), store)
    tokens = [1, 17, 99, 250, 3, 42, 7, 300, 12, 5]
    probe = pb_datum(tokens)

    def run(op: object) -> object:
        future = submit(engine, op)
        while not future.done():
            engine.run_cycle()
        return future.result()

    def lathe_logprobs(seq: int) -> torch.Tensor:
        op = fb("m", seq, [probe])
        op.forward_backward.forward_only = True
        out = run(op).forward_backward.loss_fn_outputs[0].tensors["logprobs"]
        return torch.frombuffer(bytearray(out.data), dtype=torch.float32).double()

    engine.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=base, lora_config=pb.LoraConfig(
        rank=4, seed=7, train_attn=True, train_mlp=True, train_unembed=True)))
    before = lathe_logprobs(1)
    seq = 2
    for k in range(3):
        run(fb("m", seq, [pb_datum(tokens[k:] + tokens[:k])]))
        run(opt("m", seq + 1, lr=0.01))  # moderate logits: a merge rounds W + s·BA to fp32
        seq += 2
    lathe_lp = lathe_logprobs(seq)
    assert (lathe_lp - before).abs().max() > 1e-2  # the training moved the logprobs
    saved = run(pb.TrainerOp(model_id="m", seq_id=seq + 1, tenant="t", request_id="save",
                             save=pb.SaveRequest(model_id="m", seq_id=seq + 1, name="final", kind="sampler_weights")))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name, data in store.saved[saved.save.path].items():
        (ckpt / name).write_bytes(data)

    ids, targets = torch.tensor([tokens]), torch.tensor([tokens[1:] + tokens[:1]])
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, export_peft(ckpt, tmp_path / "peft", base_dir=tiny_dir)).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        export_merged(ckpt, tmp_path / "merged", base_dir=tiny_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        peft_lp = _target_logprobs(adapted(ids).logits, targets)[0]
        merged_lp = _target_logprobs(merged(ids).logits, targets)[0]
    torch.testing.assert_close(peft_lp, lathe_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged_lp, lathe_lp, atol=1e-5, rtol=0)
