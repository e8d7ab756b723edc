"""Lathe's decoder loads Hugging Face directories and computes what transformers computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lathe.models.decoder import Decoder, Packed
from lathe.models.tiny import write_tiny_model

torch.set_num_threads(1)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("arch,tied,overrides", [
    ("llama", True, None), ("llama", False, None), ("qwen2", True, None), ("qwen3", False, None),
    ("qwen3_moe", True, None), ("qwen3_moe", False, {"mlp_only_layers": [1], "num_hidden_layers": 3}),
], ids=["llama-tied", "llama", "qwen2-tied", "qwen3", "qwen3_moe-tied", "qwen3_moe-dense-middle-layer"])
def test_logits_equal_transformers(tmp_path: Path, arch: str, tied: bool, overrides: dict | None,
                                   invariant: bool) -> None:
    d = write_tiny_model(tmp_path / arch, arch, seed=3, tie_word_embeddings=tied, overrides=overrides)
    ref = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    ours = Decoder.from_dir(d, invariant=invariant)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, ours.cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 9, 70, 130)]
    batch = Packed.from_sequences(seqs)
    with torch.no_grad():
        logits = ours.logits(ours.hidden(batch))
        for s, toks in enumerate(seqs):
            expected = ref(torch.tensor([toks])).logits[0]
            got = logits[batch.cu_seqlens[s]:batch.cu_seqlens[s + 1]]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert ours.cfg.arch == arch and ours.cfg.tie_word_embeddings == tied
    assert ("lm_head.weight" in ours.w) == (not tied)
    if overrides:
        assert [ours.cfg.sparse(i) for i in range(3)] == [True, False, True]


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    d = write_tiny_model(tmp_path / "m", "llama")
    cfg = (d / "config.json").read_text().replace("LlamaForCausalLM", "MixtralForCausalLM")
    (d / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="unsupported architectures \\['MixtralForCausalLM'\\]"):
        Decoder.from_dir(d)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_loaded_decoder_keeps_no_view_of_its_files(tmp_path: Path, tied: bool) -> None:
    """safetensors maps the files it loads; a weight left a view of that mapping (a norm, the embedding) would keep
    every read page of the file resident beside the decoder's own copies. Once loaded, the files are unmapped."""
    d = write_tiny_model(tmp_path / "llama", "llama", seed=3, tie_word_embeddings=tied)
    model = Decoder.from_dir(d)
    files = {str(f) for f in d.glob("*.safetensors")}
    mapped = {line.split(maxsplit=5)[-1].strip() for line in Path("/proc/self/maps").read_text().splitlines()
              if len(line.split(maxsplit=5)) == 6}
    assert files and not files & mapped, files & mapped
    assert model.w["model.norm.weight"].is_contiguous() and model.w["model.embed_tokens.weight"].is_contiguous()
