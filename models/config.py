"""Decoder hyperparameters, read from a Hugging Face ``config.json``.

One dataclass covers the Llama family that Lathe serves: Llama (SmolLM2), Qwen2 (q/k/v bias), Qwen3 (per-head
RMSNorm on q and k) and Qwen3-MoE (Qwen3's attention; in its sparse layers a top-k softmax router over
``num_experts`` SwiGLU experts of ``moe_intermediate_size`` instead of one MLP). Anything the decoder cannot run is
refused here, by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # 0: a dense model
    experts_per_token: int = 0  # the router's top k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top k probabilities to sum to one
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.experts_per_token} must be in [1, {self.num_experts}]")
        if self.num_experts and self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be at least 1")

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a routed mixture of experts (Hugging Face's rule for Qwen MoE layers)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
        if arch is None:
            raise ValueError(f"unsupported architectures {archs}; Lathe runs {sorted(_ARCHS)}")
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling {scaling}")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        moe = {}
        if arch == "qwen3_moe":
            moe = {"num_experts": int(raw["num_experts"]), "experts_per_token": int(raw["num_experts_per_tok"]),
                   "moe_intermediate_size": int(raw["moe_intermediate_size"]),
                   "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
                   "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
                   "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ())}
            if raw.get("shared_expert_intermediate_size"):
                raise ValueError("unsupported shared experts (shared_expert_intermediate_size); Qwen3-MoE has none")
        return cls(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 1e4))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            eos_token_ids=eos_ids,
            **moe,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
