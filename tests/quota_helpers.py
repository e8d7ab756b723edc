"""What the quota tests (test_quotas.py, test_quotas_book.py) share: the base model and rank their runs use, the
bytes a fresh adapter and a sampler checkpoint of the tiny model take (what the quota stack's limits are made
of), a tenant's clients at a stack's doors and the refusal they hear, and datums of n tokens."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np

import lathe
from lathe.stack import Stack
from tests.helpers import next_token_datum

if TYPE_CHECKING:
    from lathe.trainer.bank import Adapter

BASE = "lathe/tiny-llama"
RANK = 4


def _fresh(tiny_dir: Path, rank: int, **targets: bool) -> Adapter:
    from lathe.models.config import ModelConfig
    from lathe.models.lora import LoraSpec
    from lathe.trainer import bank

    return bank.Adapter.fresh("m", "t", BASE, ModelConfig.from_dir(tiny_dir), LoraSpec(rank=rank, **targets), seed=0)


def _sampler_checkpoint_bytes(tiny_dir: Path) -> int:
    """The bytes of a rank-RANK sampler checkpoint of the tiny model (its size does not depend on the values)."""
    return sum(len(b) for b in _fresh(tiny_dir, RANK).sampler_files().values())


def _adapter_bytes(tiny_dir: Path, rank: int, **targets: bool) -> int:
    """The bytes a fresh rank-``rank`` AdamW adapter of the tiny model holds on a trainer: weights and moments."""
    from lathe.trainer.optim_state import state_tensors

    adapter = _fresh(tiny_dir, rank, **targets)
    return sum(t.numel() * t.element_size()
               for t in (*adapter.weights.parameters(), *state_tensors(adapter.opt).values()))


def _client(stack: Stack, tenant: str, **kw: object) -> lathe.ServiceClient:
    return lathe.ServiceClient(base_url=stack.gateway, api_key=f"tml-{tenant}", **kw)


def _http(stack: Stack, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.http_url}/api/v1", headers={"X-API-Key": f"tml-{tenant}"}, timeout=60)


def _refused(r: httpx.Response, pattern: str, retry_after: bool) -> str:
    """A quota refusal at the HTTP door: 429, the message, and retry-after exactly when waiting helps."""
    assert r.status_code == 429, r.text
    assert re.fullmatch(pattern, r.json()["error"]), r.json()
    if retry_after:
        assert int(r.headers["retry-after"]) >= 1 and "x-should-retry" not in r.headers
    else:
        assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"
    return r.json()["error"]


def _datum(n: int, seed: int = 0) -> lathe.Datum:
    return next_token_datum(np.random.default_rng(seed).integers(3, 250, n + 1))


def _logprobs(out: lathe.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _runs(sc: lathe.ServiceClient) -> int:
    return sc.create_rest_client().list_training_runs().result().cursor.total_count
