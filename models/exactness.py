"""The exactness self-check a model pool runs when it loads a base model, and the pool's fingerprint.

Owns: ``self_check(decoder)`` -> ``ExactnessReport``. Touches nothing but the decoder it is given
(read-only) and torch's intra-op thread count (restored after). Trainer and sampler pools both run it;
the report goes into their logs, their Prometheus gauge, ``get_server_capabilities`` and every receipt.

Why at start, on the pool's own shapes: batch invariance is a property of the kernel library's code
paths on this machine, not of Lathe's code alone. ``PoolExactness.check`` first has ``lathe.models.tiles`` choose
the pool's tiles (``choose_tiles``: values set on the decoder); this module only checks them.

The check runs, with those ladders, at every thread count the pool may use:

1. ops at the model's shapes, rows alone vs in batches of 1, 3, 13, 17, 64 and 300 rows, and the
   300-row batch shifted by one row (which moves every row to the next position of its tile): each
   base ``linear`` (and the LM head), a sparse layer's routing (its experts and weights per row), the LoRA
   shrink/expand products, ``rms_norm``, ``log_softmax``;
   attention prefill vs each token decoded alone, chunked prefill, and batched decode of sequences of
   awkward lengths;
2. the decoder end to end with two LoRA adapters: sequences of 1, 3, 13, 17 and 64 tokens packed in
   one batch vs each alone, and prefill vs token-by-token decode through a KV cache (the stacked,
   batched decode path the sampler takes);
3. the fingerprint: a hash of the bits of one canonical packed forward (plus dtype, device kind and
   tile sizes, the ladder included). Two pools' logprobs are bitwise comparable only when their fingerprints match, so a
   trainer and a sampler on different machines are reported exact only then. The fingerprint must
   also be the same at every thread count checked.

LoRA products take their shapes from the adapter's rank, which the pool learns only when adapters arrive: the
self-check covers its own rank (8), and ``PoolExactness.check_ranks`` checks the products of every other rank
the first time an adapter of that rank is about to compute (the engines call it before the pass and wait).

The comparisons themselves are ``lathe.models.checks``. The first check that fails is named in
``first_failure``; a pool that fails still serves and says so.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from lathe.kernels import attention as attn
from lathe.kernels import tiling
from lathe.models.checks import Check, lora_checks, model_checks, op_checks
from lathe.models.decoder import Decoder
from lathe.models.pool import on_passing_thread
from lathe.models.tiles import (
    choose_lora_ladder,
    choose_tiles,
    default_threads,
)
from lathe.models.trials import at_threads

LORA_RANK = 8
"""The adapter rank the self-check covers when a pool starts (``PoolExactness.check_ranks`` adds the others)."""


@dataclass(slots=True)
class ExactnessReport:
    """What a pool found about its own bits. ``exact`` holds when every check passed."""

    exact: bool
    first_failure: str | None
    fingerprint: str
    device: str
    dtype: str
    threads: list[int]
    tiles: dict[str, object]
    seconds: float
    checks: list[Check] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    """LoRA ranks whose products were checked: the self-check's own, then each adapter rank the pool met."""

    def to_dict(self) -> dict:
        return asdict(self)

    def fields(self) -> dict[str, object]:
        """The fields of the ``Exactness`` message that pools publish (capabilities) and the SDK reads."""
        detail = f"{self.device} {self.dtype}, threads {self.threads}, tiles {self.tiles}, lora ranks {self.ranks}"
        return {"checked": True, "exact": self.exact, "first_failure": self.first_failure or "",
                "fingerprint": self.fingerprint, "detail": detail}

    def summary(self) -> str:
        """One log line: verdict, fingerprint, where, and the first failure if any."""
        verdict = "exact" if self.exact else f"NOT exact: {self.first_failure}"
        return (f"exactness self-check: {verdict}; fingerprint {self.fingerprint}; {self.device} {self.dtype}, "
                f"threads {self.threads}, {len(self.checks)} checks in {self.seconds:.1f}s")


class PoolExactness:
    """The self-check reports of one pool's loaded base models; owned by a trainer or sampler engine.

    ``check`` runs when the pool loads a model: it sets the model's ladders (``choose_ladder``, ``choose_lone``,
    ``choose_attention_tiles``), runs the self-check and logs the verdict on stderr. A pool that runs the plain
    ops (``--no-invariant``) is not exact by construction: it records that without running the check.
    """

    def __init__(self, pool: str, invariant: bool, publish: Callable[[str, bool], None] | None = None, *,
                 backward: bool = False) -> None:
        self.pool, self.invariant, self.publish = pool, invariant, publish
        self.backward = backward  # a training pool: also choose the linears' backward ladder
        self.reports: dict[str, ExactnessReport] = {}

    def check(self, name: str, model: Decoder) -> ExactnessReport:
        if self.invariant:
            choose_tiles(model, LORA_RANK, backward=self.backward)
            report = self_check(model)
        else:
            report = ExactnessReport(False, "plain ops (--no-invariant) are not batch-invariant", "", model.device.type,
                                     str(model.dtype).removeprefix("torch."), [], tiles(model), 0.0)
        logging.getLogger(f"lathe.{self.pool}").info("%s: %s", name, report.summary())
        self.reports[name] = report
        self._publish(name, report)
        return report

    def _publish(self, name: str, report: ExactnessReport) -> None:
        if self.publish is not None:
            self.publish(name, report.exact)

    def check_ranks(self, name: str, model: Decoder, ranks: set[int]) -> ExactnessReport | None:
        """Choose and check the LoRA products' ladder of each adapter rank in ``ranks`` that ``name``'s report has
        not met yet (an adapter's rank sets its products' shapes), before the adapters' first pass; the caller
        waits while a thread of the check's own runs it. Returns the report when it was checked further (its verdict may
        have changed), else None."""
        report = self.reports.get(name)
        new = sorted(ranks - set(report.ranks)) if report is not None and self.invariant else []
        if not new:
            return None
        # On a thread of its own: the check sets torch's thread count, which on the calling (compute) thread
        # would resize its OpenMP team and leave the old team's kernel-library buffers behind (measured: +0.8 GB
        # peak RSS in a SmolLM2 SFT step).
        on_passing_thread(add_rank_checks, report, model, new, name=f"lathe-{self.pool}-exactness")
        logging.getLogger(f"lathe.{self.pool}").info("%s: LoRA ranks %s checked: %s", name, new, report.summary())
        self._publish(name, report)
        return report

    def fields(self, name: str) -> dict[str, object]:
        """``ExactnessReport.fields`` of ``name``, or ``checked: False`` before the model is loaded."""
        report = self.reports.get(name)
        return report.fields() if report is not None else {"checked": False}

    def stamp(self, name: str) -> tuple[str, bool]:
        """What every receipt of a pass on ``name`` carries: its fingerprint and whether it passed ("", False
        before the model is loaded)."""
        report = self.reports.get(name)
        return (report.fingerprint, report.exact) if report is not None else ("", False)


UNPRINTED = ("lone_tile", "lone_packed", "lone_chain", "chain_rows", "chain_panels", "attn_chain",
             "lora_direct_tiles")
"""Keys of ``tiles`` left out of the fingerprint: the lone row's ways (its tile, its prepacked weights, Lathe's own
fixed-order product) and the decode steps' rows that run through that product and whether they read its panels,
chosen by time among ways of equal bits, decode attention's way (Lathe's own kernel, admitted
only where it has the library's bits), and the LoRA ladders, chosen per adapter rank as adapters arrive (after the
fingerprint is taken)."""


def tiles(model: Decoder) -> dict[str, object]:
    """The tile sizes the invariant ops use on ``model`` (but for ``UNPRINTED``, part of the fingerprint)."""
    return {"row_tile": tiling.ROW_TILE, "row_tiles": list(model.ladder.tiles),
            "grad_row_tiles": list(model.grad_ladder.tiles), "direct_tiles": list(model.ladder.direct),
            "grad_direct_tiles": list(model.grad_ladder.direct), "lone_tile": model.ladder.lone,
            "lone_packed": bool(model.packed), "lone_chain": model.ladder.chain,
            "chain_rows": model.ladder.chain_rows, "chain_panels": bool(model.panels), "attn_chain": model.attn_chain,
            "lora_direct_tiles": {rank: list(ladder.direct) for rank, ladder in sorted(model.lora_ladders.items())},
            "attn_row_tile": attn.ATTN_ROW_TILE,
            "attn_row_tiles": list(model.attn_tiles), "key_chunk": attn.KEY_CHUNK,
            "col_block_bytes": tiling.COL_BLOCK_BYTES}


def _fingerprint(model: Decoder, packed: torch.Tensor) -> str:
    h = hashlib.sha256()
    # Forward bits only: the backward ladder is a trainer's own (a sampler runs no backward), and trainer and
    # sampler of one model must print the same.
    forward = {k: v for k, v in tiles(model).items() if not k.startswith("grad_") and k not in UNPRINTED}
    h.update(f"{model.dtype}|{model.device.type}|{sorted(forward.items())}|".encode())
    h.update(packed.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def self_check(model: Decoder, *, threads: list[int] | None = None, lora_rank: int = LORA_RANK,
               seed: int = 0) -> ExactnessReport:
    """Run every check on ``model`` (with its ladders) at each thread count (default: ``default_threads``)."""
    start = time.perf_counter()
    if threads is None:
        threads = default_threads(model)
    checks: list[Check] = []
    prints: dict[int, str] = {}
    for n in threads:
        with at_threads(n):
            gen = torch.Generator().manual_seed(seed)
            ops_found = op_checks(model, gen, lora_rank)
            model_found, packed = model_checks(model, gen, lora_rank)
        checks += [Check(f"{c.name} @{n} threads", c.ok, c.detail) for c in ops_found + model_found]
        prints[n] = _fingerprint(model, packed)
    if len(set(prints.values())) > 1:
        checks.append(Check("thread count", False, f"the canonical forward's bits differ by thread count: {prints}"))
    failed = next((c for c in checks if not c.ok), None)
    return ExactnessReport(
        exact=failed is None,
        first_failure=None if failed is None else f"{failed.name}: {failed.detail}",
        fingerprint=prints[threads[0]],
        device=model.device.type,
        dtype=str(model.dtype).removeprefix("torch."),
        threads=list(threads),
        tiles=tiles(model),
        seconds=time.perf_counter() - start,
        checks=checks,
        ranks=[lora_rank],
    )


def add_rank_checks(report: ExactnessReport, model: Decoder, ranks: list[int], seed: int = 0) -> list[Check]:
    """The LoRA products at each of ``ranks`` at the report's thread counts, added to ``report``: its
    verdict turns to not exact at the first that fails (a pool that fails still serves, and says so)."""
    checks: list[Check] = []
    model.lora_ladders |= {r: choose_lora_ladder(model, r, report.threads) for r in ranks}
    report.tiles = tiles(model)
    for n in report.threads:
        with at_threads(n), torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            checks += [Check(f"{c.name} @{n} threads", c.ok, c.detail) for r in ranks
                       for c in lora_checks(model, gen, r)]
    report.ranks = sorted({*report.ranks, *ranks})
    report.checks += checks
    failed = next((c for c in checks if not c.ok), None)
    if failed is not None and report.exact:
        report.exact, report.first_failure = False, f"{failed.name}: {failed.detail}"
    return checks
