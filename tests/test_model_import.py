"""Model directories that Lathe writes (tiny test models, the SmolLM2 import) load in transformers, and
the catalog serves them by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from lathe.models.catalog import SMOLLM2, CatalogEntry, ModelCatalog
from lathe.models.smollm2 import gguf_path, import_smollm2, unpermute_rope_rows
from lathe.models.tiny import ensure_tiny_model, write_tiny_model

torch.set_num_threads(1)

ARCHS = ["llama", "qwen2", "qwen3"]
CLAMP = "def clamp(x, lo, hi):\n    return min(max(x, lo), hi)"
TEXTS = [
    CLAMP,
    "Hello, World! It's 3.14159 and 1,024 items; they're DON'T.",
    "naïve café — 東京 🙂\r\n\r\n  tabs\there   spaces  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def _file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ---------------------------------------------------------------- tiny models


@pytest.mark.processes
def test_tiny_model_is_byte_identical_for_a_seed_across_processes(tmp_path: Path) -> None:
    here = write_tiny_model(tmp_path / "here", "qwen2", seed=5)
    code = ("import sys; from pathlib import Path; from lathe.models.tiny import write_tiny_model; "
            "write_tiny_model(Path(sys.argv[1]), 'qwen2', seed=5)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True)
    files = _file_bytes(here)
    assert set(files) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "special_tokens_map.json"}
    assert files == _file_bytes(tmp_path / "there")
    other = _file_bytes(write_tiny_model(tmp_path / "other", "qwen2", seed=6))
    assert other["model.safetensors"] != files["model.safetensors"]
    assert other["tokenizer.json"] == files["tokenizer.json"]


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_model_loads_in_transformers_with_every_tensor(tmp_path: Path, arch: str, tied: bool) -> None:
    d = write_tiny_model(tmp_path / arch, arch, tie_word_embeddings=tied)
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    ours = load_file(d / "model.safetensors")
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)
    assert ("lm_head.weight" in ours) == (not tied)
    if tied:
        np.testing.assert_array_equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    assert ("model.layers.0.self_attn.q_proj.bias" in ours) == (arch == "qwen2")
    assert ("model.layers.1.self_attn.k_norm.weight" in ours) == (arch == "qwen3")
    assert ours["model.norm.weight"].std() > 0.1  # random RMSNorm weights, not ones
    tokenizer = AutoTokenizer.from_pretrained(d)
    ids = torch.tensor([tokenizer.encode(CLAMP)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    assert 0.3 < logits.std() < 10  # logits of order one: not flat, not saturated


def test_qwen3_heads_do_not_tile_the_hidden_size(tmp_path: Path) -> None:
    config = json.loads((write_tiny_model(tmp_path, "qwen3") / "config.json").read_text())
    assert config["num_attention_heads"] * config["head_dim"] == 2 * config["hidden_size"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_tokenizer_round_trips_and_agrees_with_transformers(tmp_path: Path, arch: str) -> None:
    d = write_tiny_model(tmp_path, arch)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(d)
    for text in TEXTS:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert raw.decode(ids, skip_special_tokens=False) == hf.decode(ids) == text
    assert len(raw.encode(CLAMP).ids) < len(CLAMP) / 2  # merges learned from Python code
    specials = raw.encode("<|im_start|>user<|im_end|><|endoftext|>").ids
    assert specials[0] == 1 and specials[-2:] == [2, 0] and len(specials) > 3
    config = json.loads((d / "config.json").read_text())
    assert len(hf) == raw.get_vocab_size() == config["vocab_size"]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2) == \
        (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    assert (hf.eos_token, hf.convert_ids_to_tokens(0)) == ("<|im_end|>", "<|endoftext|>")
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("vocab_size", [300, 700])
def test_vocab_size_sets_tokenizer_config_and_embeddings_alike(tmp_path: Path, vocab_size: int) -> None:
    d = write_tiny_model(tmp_path, "llama", vocab_size=vocab_size, tie_word_embeddings=False)
    assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size() == vocab_size
    assert json.loads((d / "config.json").read_text())["vocab_size"] == vocab_size
    weights = load_file(d / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape[0] == weights["lm_head.weight"].shape[0] == vocab_size


def test_vocab_size_below_the_byte_alphabet_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=200 is below 259"):
        write_tiny_model(tmp_path, vocab_size=200)


def test_ensure_tiny_model_builds_once_and_rebuilds_a_stale_version(tmp_path: Path) -> None:
    d = ensure_tiny_model(tmp_path, "llama")
    assert d == tmp_path / "tiny-llama"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]  # no temporary directory left behind
    weights = d / "model.safetensors"
    built = weights.stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, "llama") == d and weights.stat().st_mtime_ns == built
    (d / ".lathe-version").write_text("0")
    weights.write_bytes(b"corrupt")
    assert ensure_tiny_model(tmp_path, "llama") == d
    assert _file_bytes(d) | {".lathe-version": b""} == _file_bytes(write_tiny_model(tmp_path / "fresh")) | \
        {".lathe-version": b""}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "tiny-llama"]


# ---------------------------------------------------------------- catalog


def test_catalog_resolves_built_in_names_lazily(tmp_path: Path) -> None:
    catalog = ModelCatalog.default(tmp_path)
    assert catalog.names() == ["lathe/tiny-llama", "lathe/tiny-qwen2", "lathe/tiny-qwen3", "lathe/tiny-qwen3-moe",
                               SMOLLM2]
    assert list(tmp_path.iterdir()) == []  # nothing is built before it is asked for
    entry = catalog.resolve("lathe/tiny-qwen3")
    assert entry == CatalogEntry("lathe/tiny-qwen3", (tmp_path / "tiny-qwen3").resolve(), 512)
    assert json.loads((entry.path / "config.json").read_text())["model_type"] == "qwen3"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]


def test_catalog_rejects_unknown_names_naming_what_it_serves(tmp_path: Path) -> None:
    catalog = ModelCatalog.from_spec("lathe/tiny-llama, lathe/tiny-qwen2", tmp_path)
    with pytest.raises(KeyError, match="'meta-llama/Llama-3.2-1B'.*'lathe/tiny-llama', 'lathe/tiny-qwen2'"):
        catalog.resolve("meta-llama/Llama-3.2-1B")
    with pytest.raises(KeyError, match="lathe/tiny-qwen2"):
        catalog.resolve(str(tmp_path))  # a directory without config.json is no model
    with pytest.raises(ValueError, match=r"cannot serve \['lathe/tiny-mistral'\]"):
        ModelCatalog.from_spec("lathe/tiny-llama,lathe/tiny-mistral", tmp_path)


def test_catalog_serves_local_model_directories_under_their_path(tmp_path: Path) -> None:
    listed = str(write_tiny_model(tmp_path / "listed", "llama", max_position_embeddings=256))
    unlisted = str(write_tiny_model(tmp_path / "unlisted", "qwen2", max_position_embeddings=128))
    catalog = ModelCatalog.from_spec(f"lathe/tiny-llama,{listed},", tmp_path / "cache")
    assert catalog.names() == ["lathe/tiny-llama", listed]
    assert catalog.resolve(listed) == CatalogEntry(listed, Path(listed).resolve(), 256)
    assert catalog.resolve(unlisted) == CatalogEntry(unlisted, Path(unlisted).resolve(), 128)
    assert [(e.name, e.max_context_length) for e in catalog.entries()] == \
        [("lathe/tiny-llama", 512), (listed, 256), (unlisted, 128)]


# ---------------------------------------------------------------- SmolLM2


def _rope(x: np.ndarray, pos: int, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Rotate the coordinate pairs ``pairs[j]`` of ``x [d]`` by ``pos * theta_j`` (theta_j = 10000^(-2j/d))."""
    out, d = x.copy(), len(x)
    for j, (a, b) in enumerate(pairs):
        angle = pos * 10000.0 ** (-2 * j / d)
        out[a] = x[a] * np.cos(angle) - x[b] * np.sin(angle)
        out[b] = x[a] * np.sin(angle) + x[b] * np.cos(angle)
    return out


def test_unpermuted_q_k_give_llama_cpp_attention_scores_under_hf_rope() -> None:
    """llama.cpp rotates adjacent pairs (2j, 2j+1) of its stored q/k rows; Hugging Face rotates halves
    (j, j + d/2) of the un-permuted rows. Every query-key score must agree."""
    d, heads, kv, hidden = 8, 4, 2, 6
    rng = np.random.default_rng(0)
    gq, gk = rng.standard_normal((heads * d, hidden)), rng.standard_normal((kv * d, hidden))
    hq, hk = unpermute_rope_rows(gq, heads), unpermute_rope_rows(gk, kv)
    adjacent, halves = [(2 * j, 2 * j + 1) for j in range(d // 2)], [(j, j + d // 2) for j in range(d // 2)]
    x1, x2 = rng.standard_normal(hidden), rng.standard_normal(hidden)
    for h in range(heads):
        q, k = slice(h * d, (h + 1) * d), slice(h // (heads // kv) * d, (h // (heads // kv) + 1) * d)
        for p1, p2 in [(0, 0), (3, 1), (7, 5), (11, 2)]:
            ref = _rope(gq[q] @ x1, p1, adjacent) @ _rope(gk[k] @ x2, p2, adjacent)
            got = _rope(hq[q] @ x1, p1, halves) @ _rope(hk[k] @ x2, p2, halves)
            assert got == pytest.approx(ref, rel=1e-12, abs=1e-12)
    assert not np.allclose(hq, gq)


@pytest.fixture(scope="module")
def smollm2_dir(model_cache: Path) -> Path:
    return import_smollm2(model_cache)


@pytest.mark.slow
def test_smollm2_config_holds_the_gguf_hyperparameters(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert {k: config[k] for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                                   "bos_token_id", "eos_token_id")} == {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    entry = ModelCatalog.default(smollm2_dir.parent, [SMOLLM2]).resolve(SMOLLM2)
    assert entry == CatalogEntry(SMOLLM2, smollm2_dir.resolve(), 8192)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_the_gguf_vocabulary(smollm2_dir: Path) -> None:
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    reference = AutoTokenizer.from_pretrained(gguf_path().parent, gguf_file=gguf_path().name)  # transformers' reader
    gguf_ids = reference.get_vocab()  # the GGUF's tokenizer.ggml.tokens, by position
    assert ours.encode("Hello") == [gguf_ids["Hello"]]
    assert ours.encode(" world") == [gguf_ids["\u0120world"]]
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(smollm2_dir: Path) -> None:
    """Greedy decoding in transformers finds "Paris" only if q/k were un-permuted correctly."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    assert "Paris" in answer, answer
