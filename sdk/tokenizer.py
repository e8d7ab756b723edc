"""A client's tokenizer: the base model's own tokenizer files, found on this machine, never downloaded.

Owns the lookup behind ``TrainingClient.get_tokenizer`` and ``SamplingClient.get_tokenizer``. The id is what
``get_info`` reports as ``model_data.tokenizer_id`` (the gateway sets it to the run's base model name): a local
Hugging Face directory (what the cookbook passes as ``base_model``), or a built-in name of Lathe's model catalog,
materialized in the catalog's cache (``$LATHE_CACHE``, default ``.cache/lathe``) exactly as the server builds it.
As in tinker, the result is a ``transformers`` tokenizer; ``transformers`` and ``lathe.models`` are imported
only when a tokenizer is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lathe.errors import FailedPrecondition, NotFound

DEFAULT_CACHE_ROOT = Path(".cache/lathe")


def model_directory(tokenizer_id: str) -> Path:
    """The local Hugging Face directory that holds ``tokenizer_id``'s tokenizer files."""
    from lathe.models.catalog import BUILTIN, ModelCatalog, is_model_dir

    if is_model_dir(tokenizer_id):
        return Path(tokenizer_id)
    if tokenizer_id in BUILTIN:
        cache_root = Path(os.environ.get("LATHE_CACHE") or DEFAULT_CACHE_ROOT)
        return ModelCatalog.default(cache_root, [tokenizer_id]).resolve(tokenizer_id).path
    raise NotFound(f"no tokenizer for {tokenizer_id!r} on this machine: it is neither a local model directory "
                   f"nor one of Lathe's built-in models ({sorted(BUILTIN)}), and Lathe downloads nothing")


def load_tokenizer(tokenizer_id: str) -> Any:
    """``tokenizer_id``'s tokenizer as a ``transformers.PreTrainedTokenizerBase``."""
    directory = model_directory(tokenizer_id)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise FailedPrecondition("get_tokenizer needs the transformers package (pip install transformers)") from e
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
