"""The exactness self-check (lathe.models.exactness): passes on this machine, catches a shape-dependent op,
and its fingerprint is a property of the bits (same model and machine: same print; other bits: other print).

The self-check itself compares rows alone vs in batches of awkward sizes at every tile position, prefill
vs decode, at 1 and 2 threads; these tests run it on the generated tiny models in fp32 and bf16.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lathe.kernels import attention as attn
from lathe.kernels import ops, tiling
from lathe.models import attention_tiles, checks, exactness, tiles, trials
from lathe.models.decoder import Decoder, layer_weight_names
from lathe.models.lora import LoraSpec, LoraWeights, module_shape
from lathe.models.lora_batch import LoraBatch
from lathe.models.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def qwen3_dir(model_cache: Path) -> Path:
    return ensure_tiny_model(model_cache, "qwen3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_self_check_passes_on_this_machine_at_one_and_two_threads(tiny_dir: Path, dtype: torch.dtype) -> None:
    report = exactness.self_check(Decoder.from_dir(tiny_dir, dtype=dtype), threads=[1, 2])
    assert report.exact, report.first_failure
    assert report.first_failure is None
    assert report.threads == [1, 2]
    names = {c.name.split(" @")[0].split(" ")[0] for c in report.checks}
    assert {"linear", "lora", "rms_norm", "log_softmax", "attention", "decoder"} <= names
    assert len(report.checks) >= 2 * 12  # every op shape, the decoder, at both thread counts
    assert report.dtype == str(dtype).removeprefix("torch.") and report.device == "cpu"


def test_self_check_covers_a_mixture_of_experts_routing_and_its_experts(model_cache: Path) -> None:
    """On the tiny Qwen3-MoE the pool checks its router's product and routing (each row's experts and weights alone
    and in batches), its experts' shapes (base and LoRA), and the decoder end to end, and all pass here."""
    model = Decoder.from_dir(ensure_tiny_model(model_cache, "qwen3_moe"))
    report = exactness.self_check(model, threads=[2])
    names = [c.name for c in report.checks]
    assert report.exact, report.first_failure
    assert "moe routing 8 experts top 2 @2 threads" in names and "linear gate 64->8 @2 threads" in names
    assert "linear down_proj 32->64 @2 threads" in names and "lora expand 8->32 @2 threads" in names


def test_self_check_covers_qk_norm_and_bias_models(qwen3_dir: Path) -> None:
    report = exactness.self_check(Decoder.from_dir(qwen3_dir), threads=[2])
    assert report.exact, report.first_failure


def test_a_shape_dependent_matmul_is_caught_and_named(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear whose rows change with the row count (as MKL's do past a size threshold) fails the check."""

    def shape_dependent(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        invariant: bool, **ladders: tuple[int, ...]) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        y = F.linear(x, weight, bias)
        return y * (1 + 2**-20) if rows >= 16 else y

    monkeypatch.setattr(ops, "linear", shape_dependent)
    report = exactness.self_check(Decoder.from_dir(tiny_dir), threads=[1])
    assert not report.exact
    assert report.first_failure.startswith("linear q_proj"), report.first_failure
    assert "alone differs" in report.first_failure
    assert "NOT exact: linear q_proj" in report.summary()


def test_a_prefill_only_attention_change_is_caught_by_the_attention_check(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention that rounds differently once it sees many queries breaks prefill vs decode: caught there."""
    real = attn.attention

    def drifting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        out = real(q, k, v, **kw)
        return out * (1 + 2**-20) if q.shape[0] > 1 else out

    monkeypatch.setattr(attn, "attention", drifting)
    report = exactness.self_check(Decoder.from_dir(tiny_dir), threads=[1])
    assert not report.exact
    assert report.first_failure.startswith("attention"), report.first_failure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_pool_ladder_keeps_every_bit_of_the_reference_tile(tiny_dir: Path, dtype: torch.dtype) -> None:
    """The pool widens its linear and attention tiles only to heights whose bits equal the reference tiles':
    the packed logprobs and the fingerprint's bits are the same with the chosen ladders as with the references."""
    model = Decoder.from_dir(tiny_dir, dtype=dtype)
    reference = checks.packed_logprobs(model, torch.Generator().manual_seed(5), 4)[2]
    pool = exactness.PoolExactness("trainer", invariant=True)
    report = pool.check("tiny", model)
    assert report.exact, report.first_failure
    assert tiling.ROW_TILE in model.ladder.tiles and report.tiles["row_tiles"] == list(model.ladder.tiles)
    assert set(model.ladder.tiles) <= {tiling.ROW_TILE, *tiling.ROW_TILE_CANDIDATES}
    assert attn.ATTN_ROW_TILE in model.attn_tiles and report.tiles["attn_row_tiles"] == list(model.attn_tiles)
    assert set(model.attn_tiles) <= {attn.ATTN_ROW_TILE, *attn.ATTN_TILE_CANDIDATES}
    ladder = checks.packed_logprobs(model, torch.Generator().manual_seed(5), 4)[2]
    assert torch.equal(ladder, reference)


def test_a_pool_times_the_ways_of_running_a_lone_row_and_all_keep_the_reference_bits(tiny_dir: Path) -> None:
    """``choose_lone`` picks among a lone row zero-padded to a direct tile, one in the smallest tile of the ladder and
    (where ``choose_chain`` admitted a block) Lathe's own fixed-order product, by time; each gives every linear's
    lone row the reference tile's bits, so the choice is left out of the fingerprint: a pool that chose another
    way prints the same."""
    model = Decoder.from_dir(tiny_dir)
    ladder = tiles.choose_ladder(tiles.model_weights(model), [1, 2], tiles_too=True)
    chosen = tiles.choose_lone(model, ladder, [1, 2], repeats=1)
    if ladder.direct:
        ways = [dataclasses.replace(ladder, lone=lone, chain=0) for lone in (0, min(ladder.tiles))]
        ways += [ladder] if ladder.chain else []
        ways = [way for way in ways if trials.lone_row_failure(model, way, [1, 2]) is None]
        ways = ways or [dataclasses.replace(ladder, tiles=(tiling.ROW_TILE,), lone=tiling.ROW_TILE, chain=0)]
    else:
        ways = [ladder]
    assert chosen in ways
    row = torch.randn(1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for weight in (*tiles.model_weights(model)[:-1], model.lm_head):
        if weight.shape[1] != row.shape[1]:
            continue
        ref = ops.tiled_matmul(row, weight.t())
        for way in ways:
            got = ops.linear(row, weight, invariant=True, ladder=way)
            assert torch.equal(got, ref), (tuple(weight.shape), way)
    prints = set()
    for way in ways:
        model.ladder = way
        prints.add(exactness.self_check(model, threads=[1]).fingerprint)
    assert len(prints) == 1


def test_a_lone_row_rounding_otherwise_once_in_many_outputs_is_found_and_refused(tiny_dir: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """A bf16 one-row product can round an output in ~10^5 otherwise than its tile (measured on an AVX-512 EPYC:
    the tiny Qwen3-MoE's sampler then differed from its trainer): ``lone_row_failure`` runs enough lone rows to see
    it, names the weight and the row, and ``choose_lone`` then runs lone rows in the reference tile. Here one
    element of the 700th lone row of each weight is changed, a row no trial of a few rows reaches."""
    model = Decoder.from_dir(tiny_dir, dtype=torch.bfloat16)
    ladder = tiling.Ladder(tiles=(4, tiling.ROW_TILE), direct=(tiling.ROW_TILE,), lone=4)
    assert trials.lone_row_failure(model, ladder, [1]) is None
    linear, lone_calls = ops.linear, [0]

    def nudged(x: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        y = linear(x, weight, *args, **kwargs)
        if x.shape[0] > 1:  # a weight's reference products, after its lone rows
            lone_calls[0] = 0
        elif kwargs.get("ladder", tiling.REFERENCE) != tiling.REFERENCE:
            lone_calls[0] += 1
            if lone_calls[0] == 700:
                y = y.clone()
                y[0, 3] += 1
        return y

    monkeypatch.setattr(ops, "linear", nudged)
    assert trials.trial_rows(model.cfg.hidden_size, torch.bfloat16) > 700 > trials.trial_rows(64, torch.float32)
    failure = trials.lone_row_failure(model, ladder, [1])
    assert failure is not None and "lone row 699 of 1024 differs from its reference tile" in failure, failure
    chosen = tiles.choose_lone(model, ladder, [1], repeats=1)
    assert (chosen.lone, chosen.tiles, chosen.chain) == (tiling.ROW_TILE, (tiling.ROW_TILE,), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prepacked_lone_rows_are_used_only_where_they_keep_the_padded_tiles_bits(tiny_dir: Path,
                                                                                 dtype: torch.dtype) -> None:
    """``choose_packed`` gives a sampling pool's lone decode rows prepacked layer weights only where
    ``packed_agrees`` found their products bitwise the zero-padded direct tile's. Where they agree, a decoded lone
    row's logprobs through the copies equal those without, bit for bit; where they do not (or lone rows run in
    tiles), the pool gets none; a training pool never does."""
    model = Decoder.from_dir(tiny_dir, dtype=dtype)
    name = layer_weight_names(model.cfg)[0]  # oneDNN refuses to pack bf16 on an AVX2 CPU: None, not an error
    assert ops.prepack(model.w[name], 4) is None or ops.prepack(model.w[name], 4).dtype == dtype
    tiles.choose_tiles(model, 8, backward=True)
    assert model.packed == {}
    tiles.choose_tiles(model, 8, backward=False)
    usable = model.ladder.direct and not model.ladder.lone and tiles.packed_agrees(model, [1, 2])
    if not usable:
        assert model.packed == {}
        return
    assert set(model.packed) <= set(layer_weight_names(model.cfg))
    copies = {n: ops.prepack(model.w[n], min(model.ladder.direct)) for n in layer_weight_names(model.cfg)}
    adapters = checks.random_adapters(model, 8, torch.Generator().manual_seed(4))
    out = []
    for packed in ({}, copies):  # one token alone: every linear runs a lone row
        model.packed = packed
        with torch.no_grad():
            out.append(checks.logprobs(model, [[5]], [[3]], checks.layout([1], adapters[:1])))
    assert torch.equal(out[0], out[1])


def test_each_adapter_rank_gets_a_lora_ladder_whose_lone_rows_have_the_reference_bits(tiny_dir: Path) -> None:
    """A pool chooses the LoRA products' ladder of its own rank at start and of each new rank before its first
    pass; a decode step of one adapter (one segment, no autograd) runs over it with the reference tile's bits."""
    model = Decoder.from_dir(tiny_dir)
    pool = exactness.PoolExactness("sampler", invariant=True)
    assert pool.check("tiny", model).exact
    report = pool.check_ranks("tiny", model, {4})
    assert report.exact and set(model.lora_ladders) == {exactness.LORA_RANK, 4}
    chosen = {rank: list(ladder.direct) for rank, ladder in sorted(model.lora_ladders.items())}
    assert report.tiles["lora_direct_tiles"] == chosen
    adapter = LoraWeights.init(model.cfg, LoraSpec(rank=4), seed=1)
    with torch.no_grad():
        for b in adapter.b.values():
            b.normal_(generator=torch.Generator().manual_seed(2))
        for rows in (1, 3, 21):
            x = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
            one = LoraBatch([0, rows], [0], [adapter])
            for key in [k for k in adapter.a if module_shape(model.cfg, k[1])[0] == x.shape[1]]:
                assert torch.equal(one.delta(key, x, model.lora_ladders), one.delta_per_segment(key, x)), (key, rows)


def test_a_tile_height_with_other_bits_is_left_out_of_the_ladder(tiny_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate height whose products round differently (as MKL's 8-row tiles do under its AVX2 path)
    is not chosen; the others still are judged by their own bits."""
    real = ops.tiled_matmul

    def off_at_64(x: torch.Tensor, w: torch.Tensor, *, tile: int = tiling.ROW_TILE) -> torch.Tensor:
        y = real(x, w, tile=tile)
        return y * (1 + 2**-20) if tile == 64 else y

    monkeypatch.setattr(ops, "tiled_matmul", off_at_64)
    model = Decoder.from_dir(tiny_dir)
    ladder = tiles.choose_row_tiles(tiles.model_weights(model), [1])
    assert 64 not in ladder and tiling.ROW_TILE in ladder


def test_an_attention_tile_height_with_other_bits_is_left_out_of_its_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill attention's ladder is judged by bits too: a height whose products round differently is not
    chosen, and the reference height (the one decode uses) always is."""
    real = attn._chunked_attention

    def off_at_64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,
                  t: int) -> torch.Tensor:
        out = real(q, k, v, q_offset, scale, t)
        return out * (1 + 2**-20) if t == 64 else out

    monkeypatch.setattr(attn, "_chunked_attention", off_at_64)
    ladder = attention_tiles.choose_attention_tiles(6, 2, 16, torch.float32, torch.device("cpu"), [1])
    assert 64 not in ladder and attn.ATTN_ROW_TILE in ladder


def test_fingerprint_is_the_same_for_the_same_bits_and_differs_for_other_bits(tiny_dir: Path) -> None:
    one = exactness.self_check(Decoder.from_dir(tiny_dir), threads=[1])
    two = exactness.self_check(Decoder.from_dir(tiny_dir), threads=[2])
    assert one.fingerprint == two.fingerprint  # bits do not depend on the thread count, so neither does the print
    bf16 = exactness.self_check(Decoder.from_dir(tiny_dir, dtype=torch.bfloat16), threads=[1])
    assert bf16.fingerprint != one.fingerprint


def test_report_serialises_with_every_check(tiny_dir: Path) -> None:
    report = exactness.self_check(Decoder.from_dir(tiny_dir), threads=[1])
    d = report.to_dict()
    assert d["exact"] is True and d["fingerprint"] == report.fingerprint
    assert d["tiles"] == {"row_tile": tiling.ROW_TILE, "row_tiles": [tiling.ROW_TILE],
                          "grad_row_tiles": [tiling.ROW_TILE], "direct_tiles": [], "grad_direct_tiles": [],
                          "lone_tile": tiling.ROW_TILE,
                          "lone_packed": False, "lone_chain": 0, "chain_rows": 0, "chain_panels": False,
                          "attn_chain": 0,
                          "lora_direct_tiles": {},
                          "attn_row_tile": attn.ATTN_ROW_TILE,
                          "attn_row_tiles": [attn.ATTN_ROW_TILE], "key_chunk": attn.KEY_CHUNK,
                          "col_block_bytes": tiling.COL_BLOCK_BYTES}
    assert len(d["checks"]) == len(report.checks) and all(c["ok"] for c in d["checks"])


def _receipt(op: str, fingerprint: str, exact: bool = True) -> object:
    from lathe.v1 import lathe_pb2 as pb

    return pb.Receipt(op=op, fingerprint=fingerprint, exact=exact)


def test_sdk_warns_once_when_a_pool_is_not_exact() -> None:
    from lathe.futures import ExactnessWatch

    watch = ExactnessWatch()
    watch.see(_receipt("forward_backward", "aa"))
    with pytest.warns(RuntimeWarning, match="sampler pool that ran 'sample' \\(fingerprint ''\\) is not exact"):
        watch.see(_receipt("sample", "", exact=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.see(_receipt("sample", "", exact=False))  # once per client


def test_sdk_warns_when_trainer_and_sampler_fingerprints_differ_and_not_when_they_match() -> None:
    from lathe.futures import ExactnessWatch

    same = ExactnessWatch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for op in ("forward_backward", "sample", "optim_step", "sample"):
            same.see(_receipt(op, "aa"))
    other = ExactnessWatch()
    other.see(_receipt("forward", "aa"))
    with pytest.warns(RuntimeWarning, match=r"trainer fingerprints \['aa'\] differ from sampler fingerprints \['bb'\]"):
        other.see(_receipt("sample", "bb"))


def test_an_adapter_rank_is_checked_the_first_time_the_pool_meets_it(tiny_dir: Path) -> None:
    """LoRA products take their shapes from the adapter's rank: each new rank is checked once, before use."""
    published: list[tuple[str, bool]] = []
    pool = exactness.PoolExactness("trainer", invariant=True, publish=lambda name, exact: published.append((name,
                                                                                                           exact)))
    model = Decoder.from_dir(tiny_dir)
    report = pool.check("tiny", model)
    assert report.ranks == [8] and published == [("tiny", True)]
    assert pool.check_ranks("tiny", model, {8}) is None
    again = pool.check_ranks("tiny", model, {24, 8})
    assert again is report and report.ranks == [8, 24] and report.exact
    assert any(c.name.startswith("lora shrink") and "->24 @" in c.name and c.ok for c in report.checks)
    assert any(c.name.startswith("lora expand 24->") for c in report.checks)
    assert "lora ranks [8, 24]" in report.fields()["detail"]
    assert published == [("tiny", True), ("tiny", True)]


def test_a_rank_whose_products_change_with_the_batch_turns_the_pool_not_exact(tiny_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank-24 shrink that rounds differently in larger batches is caught when rank 24 first arrives."""
    real = ops.linear

    def drifting(x: torch.Tensor, weight: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        y = real(x, weight, *args, **kw)
        return y * (1 + 2**-20) if weight.shape[0] == 24 and x.shape[0] > 1 else y

    published: list[tuple[str, bool]] = []
    pool = exactness.PoolExactness("sampler", invariant=True, publish=lambda name, exact: published.append((name,
                                                                                                           exact)))
    model = Decoder.from_dir(tiny_dir)
    pool.check("tiny", model)
    monkeypatch.setattr(ops, "linear", drifting)
    report = pool.check_ranks("tiny", model, {24})
    assert report is not None and not report.exact
    assert report.first_failure.startswith("lora shrink") and "->24" in report.first_failure
    assert "alone differs" in report.first_failure
    assert published[-1] == ("tiny", False)
