"""Export a Lathe checkpoint for other runtimes: a PEFT adapter directory, or a merged Hugging Face model.

Input: the files of a checkpoint (``adapter_model.safetensors`` with PEFT-named LoRA tensors and
``adapter_config.json``, as the trainer saves them) and, for ``merged``, the base model's Hugging Face
directory. Output: ``peft`` writes an adapter directory that ``peft.PeftModel.from_pretrained`` loads
onto the base model; ``merged`` writes a model directory with ``W' = W + (alpha / r) * B @ A`` for every
LoRA target, which ``transformers`` loads alone. Both write ``lathe_export.json`` (base model, rank,
alpha, tinker path, source metadata). Torch is imported only when merging (the SDK stays torch-free).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lathe.errors import FailedPrecondition, InvalidArgument

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
METADATA = "lathe_export.json"
_PREFIX = "base_model.model."


def _config(checkpoint_dir: Path) -> dict[str, Any]:
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (checkpoint_dir / name).is_file():
            raise FailedPrecondition(f"checkpoint directory {str(checkpoint_dir)!r} has no {name}")
    return json.loads((checkpoint_dir / ADAPTER_CONFIG).read_text())


def _metadata(config: dict[str, Any], tinker_path: str, base_dir: Path, kind: str,
              source_metadata: dict[str, Any]) -> dict[str, Any]:
    return {"export": kind, "tinker_path": tinker_path, "base_model": source_metadata.get("base_model",
            config.get("base_model_name_or_path")), "base_model_dir": str(base_dir), "rank": config["r"],
            "alpha": config["lora_alpha"], "target_modules": config["target_modules"],
            "checkpoint_metadata": source_metadata}


def write_peft(files: Mapping[str, bytes], out: Path, *, base_model: str, metadata: Mapping[str, Any]) -> Path:
    """Write the PEFT adapter directory of a checkpoint's ``files`` (``adapter_model.safetensors`` and
    ``adapter_config.json``, as the trainer saves them) at ``out``: the weights as they are, the config naming
    ``base_model`` as its ``base_model_name_or_path``, and ``metadata`` as ``lathe_export.json``. ``export_peft``
    writes with it, and so does the sampler's sglang engine when it publishes an adapter to its SGLang server."""
    missing = [name for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if name not in files]
    if missing:
        raise FailedPrecondition(f"checkpoint has no {missing}: not a sampler checkpoint")
    config = json.loads(files[ADAPTER_CONFIG])
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_WEIGHTS).write_bytes(files[ADAPTER_WEIGHTS])
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": base_model}, indent=1))
    (out / METADATA).write_text(json.dumps(dict(metadata), indent=1))
    return out


def export_peft(checkpoint_dir: Path, out: Path, *, base_dir: Path, tinker_path: str = "",
                source_metadata: dict[str, Any] | None = None) -> Path:
    """Write a PEFT adapter directory at ``out`` whose ``base_model_name_or_path`` is ``base_dir``."""
    config = _config(checkpoint_dir)
    files = {name: (checkpoint_dir / name).read_bytes() for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}
    return write_peft(files, out, base_model=str(base_dir),
                      metadata=_metadata(config, tinker_path, base_dir, "peft", source_metadata or {}))


def export_merged(checkpoint_dir: Path, out: Path, *, base_dir: Path, tinker_path: str = "",
                  source_metadata: dict[str, Any] | None = None) -> Path:
    """Write ``base_dir``'s model with the adapter merged in (``W + scale * B @ A``) at ``out``.

    A LoRA on ``lm_head`` of a model with tied embeddings unties them: the merged head is its own tensor.
    """
    import torch
    from safetensors.torch import load_file, save_file

    config = _config(checkpoint_dir)
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(checkpoint_dir / ADAPTER_WEIGHTS))
    weights_file = base_dir / "model.safetensors"
    if not weights_file.is_file():
        raise FailedPrecondition(f"base model directory {str(base_dir)!r} has no model.safetensors")
    weights = load_file(str(weights_file))
    model_config = json.loads((base_dir / "config.json").read_text())
    modules = sorted({n.removeprefix(_PREFIX).rsplit(".lora_", 1)[0] for n in lora})
    for module in tqdm(modules, desc="merging LoRA", unit="module"):
        a, b = lora[f"{_PREFIX}{module}.lora_A.weight"], lora[f"{_PREFIX}{module}.lora_B.weight"]
        key = f"{module}.weight"
        if module == "lm_head":  # a tied head would be re-tied to the embedding on load: untie it
            model_config["tie_word_embeddings"] = False
            if key not in weights:
                weights[key] = weights["model.embed_tokens.weight"].clone()
        if key not in weights:
            raise InvalidArgument(f"adapter targets {module!r}, which the base model in {str(base_dir)!r} lacks")
        w = weights[key]
        weights[key] = (w.to(torch.float64) + scale * (b.to(torch.float64) @ a.to(torch.float64))).to(w.dtype)
    out.mkdir(parents=True, exist_ok=True)
    for item in base_dir.iterdir():  # tokenizer, generation config, ...
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            shutil.copyfile(item, out / item.name)
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model_config, indent=1))
    (out / METADATA).write_text(json.dumps(_metadata(config, tinker_path, base_dir, "merged", source_metadata or {}),
                                            indent=1))
    return out
