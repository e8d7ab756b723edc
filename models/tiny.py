"""Tiny Hugging Face checkpoints that tests generate in about a second, with no download.

Owns the tiny-model generator (``write_tiny_model``, ``ensure_tiny_model``) and the pieces of a Hugging
Face model directory that every Lathe importer writes the same way: the Llama-family ``config.json``
(``hf_config``), the tokenizer files (``write_tokenizer_files``) and the build-once, atomic cache
directory (``build_once``). ``lathe.models.smollm2`` reuses those three.

A tiny directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32, HF
tensor names, see ``tensor_shapes``), ``tokenizer.json`` (byte-level BPE trained on a fixed built-in
corpus of English and Python), ``tokenizer_config.json`` and ``special_tokens_map.json``. Its special
tokens take SmolLM2's ids: ``<|endoftext|>`` 0, ``<|im_start|>`` 1 (bos), ``<|im_end|>`` 2 (eos, pad).
The same seed and arguments give byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

Arch = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 1, 2, 2, 0
DEFAULT_VOCAB_SIZE = 512
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer split: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, spaces. transformers rebuilds every ``qwen2`` tokenizer with it (and NFC),
# so the tiny tokenizer uses it for every arch and both libraries cut text the same way.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TINY_VERSION = "2"  # bump when the generated files change, so cached copies are rebuilt
_VERSION_FILE = ".lathe-version"

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}
_ROPE_THETA = {"llama": 100000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "qwen3_moe": 1000000.0}
_RMS_NORM_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6, "qwen3_moe": 1e-6}
# The tiny Qwen3-MoE: 8 experts of width 32, top 2, renormalized, every layer sparse (as in the published Qwen3-MoE
# models; ``write_tiny_model``'s ``overrides`` makes some dense, e.g. ``{"mlp_only_layers": [1]}``).
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
            "output_router_logits": False}

# The tokenizer's training text: plain English and Python, written for this file.
_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A small model learns the shape of its data.
Researchers write the training loop on their own machine, and the service runs the heavy math.
Each user trains a low-rank adapter on one shared base model, so many people can work at once.
The sampler reads the latest saved weights and returns tokens with their log probabilities.
What is the capital of France? The capital of France is Paris. Berlin is the capital of Germany.
Please write a function that returns the value clamped between the lower and the upper bound.
If the value is smaller than the lower bound, return the lower bound; if it is larger than the
upper bound, return the upper bound; otherwise return the value itself. Tests check every case.
Numbers such as 0, 1, 2, 3, 10, 42, 100, 256, 1024 and 3.14 appear in code and in sentences.
Good tests compare against a reference computed another way, and they would fail if the code
were wrong. The answer is correct when the reward is one and wrong when the reward is zero.
Training moves the weights a little at every step; the optimizer keeps a running average of
the gradients and of their squares. When the learning rate is too large, the loss jumps around.
Tokenizers split text into pieces: whole words for common ones, smaller parts for rare ones.

def clamp(x, lo, hi):
    """Return x limited to the closed interval [lo, hi]."""
    return min(max(x, lo), hi)


def clamp_with_branches(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


class Counter:
    """Count how often each item appears."""

    def __init__(self):
        self.counts = {}

    def add(self, item, times=1):
        self.counts[item] = self.counts.get(item, 0) + times
        return self.counts[item]

    def most_common(self, n=3):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    total = 0.0
    for value in values:
        total += value
    return total / len(values)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f if line.strip()]


for i in range(10):
    print(f"step {i}: loss={1.0 / (i + 1):.4f}")

assert clamp(5, 0, 10) == 5
assert clamp(-3, 0, 10) == 0
assert clamp(12, 0, 10) == 10
result = [clamp(x, -1, 1) for x in [-2, -1, 0, 1, 2]]
print(result, len(result), sum(result), isinstance(result, list), None, True, False)


def tokenize(text):
    """Split text into lower-case words, dropping punctuation."""
    words = []
    for word in text.split():
        word = word.strip(".,;:!?()[]{}\"'").lower()
        if word:
            words.append(word)
    return words


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)


try:
    value = int(input("Enter a number: "))
except ValueError as error:
    print("That was not a number:", error)
else:
    print("You entered", value, "and its square is", value * value)
'''


# ---------------------------------------------------------------- shared Hugging Face directory pieces


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def hf_config(arch: Arch, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
              num_attention_heads: int, num_key_value_heads: int, head_dim: int, max_position_embeddings: int,
              rope_theta: float, rms_norm_eps: float, tie_word_embeddings: bool) -> dict:
    """A transformers ``config.json`` for a Llama, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) or Qwen3-MoE (Qwen3 with
    ``TINY_MOE``'s experts) decoder."""
    config = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": rms_norm_eps,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    elif arch in ("qwen3", "qwen3_moe"):
        config |= {"attention_bias": False}
    if arch == "qwen3_moe":
        config |= TINY_MOE
    if arch != "llama":
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_hidden_layers}
    return config


def write_generation_config(out_dir: Path) -> None:
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})


def write_tokenizer_files(out_dir: Path, tokenizer: Tokenizer, *, chat_template: str, model_max_length: int) -> None:
    """``tokenizer.json`` plus the two files ``transformers.AutoTokenizer`` reads beside it.

    The special tokens are ``SPECIAL_TOKENS`` at ids 0, 1, 2 (checked here): bos ``<|im_start|>``,
    eos and pad ``<|im_end|>``, unk ``<|endoftext|>``."""
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise ValueError(f"special token {token!r} has id {tokenizer.token_to_id(token)}, expected {i}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    names = {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
             "pad_token": SPECIAL_TOKENS[PAD_ID], "unk_token": SPECIAL_TOKENS[UNK_ID]}
    write_json(out_dir / "special_tokens_map.json",
               names | {"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    })


def build_once(target: Path, build: Callable[[Path], None], version: str) -> Path:
    """Return ``target``, first running ``build(tmp)`` into a temporary sibling and renaming it into
    place when ``target`` is missing or was built by another ``version``. Readers never see a
    half-written directory, and of two concurrent builders the first rename wins."""
    if _is_current(target, version):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / _VERSION_FILE).write_text(version)
        tmp.chmod(0o755)  # mkdtemp makes it private
        if _is_current(target, version):  # another builder finished first
            return target
        if target.exists():  # built by another version: move it aside, then swap the new one in
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            os.replace(target, stale / target.name)
            shutil.rmtree(stale)
        os.rename(tmp, target)
    except OSError:
        if not _is_current(target, version):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(target: Path, version: str) -> bool:
    stamp = target / _VERSION_FILE
    return stamp.is_file() and stamp.read_text() == version


# ---------------------------------------------------------------- the tiny model


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE with exactly ``vocab_size`` tokens: the special tokens, the 256 byte symbols, merges
    learned from the built-in corpus, then ``<|reserved_i|>`` tokens if the corpus runs out of merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(f"vocab_size={vocab_size} is below {len(SPECIAL_TOKENS) + len(alphabet)} "
                         "(special tokens + 256 byte symbols)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, initial_alphabet=alphabet,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                                  for i in range(missing)])
    return tokenizer


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``model.safetensors`` by its Hugging Face name, in a fixed order."""
    h, heads, kv, d = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    arch = config["model_type"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, heads * d),
            p + "post_attention_layernorm.weight": (h,),
        }
        shapes |= _mlp_shapes(config, i)
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{n}_proj.bias": (m * d,) for n, m in (("q", heads), ("k", kv), ("v", kv))}
        if arch in ("qwen3", "qwen3_moe"):
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def _mlp_shapes(config: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer ``layer``'s MLP tensors: one SwiGLU MLP, or a sparse layer's router and experts (Hugging Face's
    per-expert names, as MoE checkpoints are published)."""
    p, h = f"model.layers.{layer}.mlp.", config["hidden_size"]
    experts = config.get("num_experts", 0)
    sparse = experts and layer not in config["mlp_only_layers"] and (layer + 1) % config["decoder_sparse_step"] == 0
    if not sparse:
        f = config["intermediate_size"]
        return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f)}
    f = config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (experts, h)}
    for e in range(experts):
        q = f"{p}experts.{e}."
        shapes |= {q + "gate_proj.weight": (f, h), q + "up_proj.weight": (f, h), q + "down_proj.weight": (h, f)}
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """RMSNorm weights uniform in [0.5, 1.5], biases N(0, 0.1²), matrices N(0, 1/fan_in): attention
    scores and logits of order one, so position, head and norm mistakes change the output."""
    if name.endswith("norm.weight"):
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    if name.endswith(".bias"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))


def write_tiny_model(out_dir: Path, arch: Arch = "llama", *, seed: int = 0, hidden_size: int = 64,
                     intermediate_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 4,
                     num_key_value_heads: int = 2, head_dim: int | None = None, max_position_embeddings: int = 512,
                     tie_word_embeddings: bool = True, vocab_size: int | None = None,
                     overrides: dict | None = None) -> Path:
    """Write a random tiny ``arch`` checkpoint with its tokenizer into ``out_dir`` and return it.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``, except for Qwen3, where it is twice
    that, so that, as in real Qwen3 models, ``num_attention_heads * head_dim != hidden_size``.
    ``vocab_size`` (default 512) is both the tokenizer's size and the config's. ``overrides``: config.json
    entries to change (a Qwen3-MoE's ``mlp_only_layers``, say), applied before the tensors are drawn."""
    if arch not in _HF_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_HF_CLASSES)}")
    tokenizer = train_tokenizer(vocab_size or DEFAULT_VOCAB_SIZE)
    if head_dim is None:
        head_dim = hidden_size // num_attention_heads * (2 if arch in ("qwen3", "qwen3_moe") else 1)
    config = hf_config(
        arch, vocab_size=tokenizer.get_vocab_size(), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        rope_theta=_ROPE_THETA[arch], rms_norm_eps=_RMS_NORM_EPS[arch], tie_word_embeddings=tie_word_embeddings,
    ) | (overrides or {})
    rng = np.random.default_rng(seed)
    weights = {name: _random_tensor(name, shape, rng) for name, shape in tensor_shapes(config).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "config.json", config)
    write_generation_config(out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(out_dir, tokenizer, chat_template=CHATML_TEMPLATE, model_max_length=max_position_embeddings)
    return out_dir


def ensure_tiny_model(cache_root: Path, arch: Arch = "llama") -> Path:
    """The default tiny ``arch`` model (seed 0) under ``cache_root/tiny-<arch>``, written once."""
    return build_once(Path(cache_root) / f"tiny-{arch}", lambda tmp: write_tiny_model(tmp, arch), _TINY_VERSION)
