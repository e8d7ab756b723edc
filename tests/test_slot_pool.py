"""The sampler's adapter slot pool and BGMV: stacked rank-padded buffers, one adapter slot per row.

Protects: the torch reference BGMV (``lathe.kernels.lora``) equals the per-segment reference ops with one
segment per row, and gives rows without an adapter a zero correction; a ``SlotBatch`` over a ``SlotPool``
gives every target module of the tiny model the correction the per-segment ``LoraBatch`` path gives
(within fp32 rounding: rank padding changes the reductions); slots are reused for a resident adapter,
evicted least recently used but never while running sequences use them, and a full pool or a too-large
rank is refused with its reason; a step's placement never evicts an adapter the same step needs; the Triton
BGMV kernels equal the torch reference under the interpreter (a child process with TRITON_INTERPRET=1).
Through the engine (the torch BGMV standing in for Triton, so the CPU drives the engine's slot path): greedy
tokens equal and logprobs within fp32 rounding of the per-segment path, with more adapters than slots
(steps that do not fit fall back, later steps evict a finished adapter's slot while others run); the
invariant mode refuses the BGMV path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lathe.errors import ResourceExhausted
from lathe.kernels import lora
from lathe.models.config import ModelConfig
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.lora_batch import LoraBatch
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.sampler.slots import SlotBatch, SlotPool
from tests.test_sampler import BASE, make_engine, ok, pump, request, source_for, wait_waiting

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def adapter(cfg: ModelConfig, rank: int, seed: int, **targets: bool) -> LoraWeights:
    w = LoraWeights.init(cfg, LoraSpec(rank=rank, **targets), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in w.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return LoraWeights(w.spec, {k: t.detach() for k, t in w.a.items()}, {k: t.detach() for k, t in w.b.items()})


def test_torch_bgmv_equals_the_per_segment_reference_per_row() -> None:
    T, H, out, R, N = 11, 24, 10, 6, 3
    gen = torch.Generator().manual_seed(0)
    x, A, B = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((T, H), (N, R, H), (N, out, R)))
    scale = torch.rand(N, generator=gen, dtype=torch.float64)
    idx = torch.tensor([0, 2, 2, -1, 1, 0, -1, 1, 2, 0, 1])
    rows = torch.arange(T + 1), idx.clamp(min=0)
    want = lora.lora_delta(x, A, B, scale, *rows).masked_fill((idx < 0)[:, None], 0.0)
    got = lora.lora_delta_bgmv(x, A, B, scale, idx)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not got[idx < 0].any()
    with pytest.raises(ValueError, match="idx holds slot 3, but only 3 slots are stacked"):
        lora.bgmv_shrink(x, A, torch.full((T,), 3))


def test_slot_batch_gives_the_per_segment_corrections(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    ws = [adapter(cfg, 2, 1), adapter(cfg, 8, 2, train_mlp=False), adapter(cfg, 4, 3, train_attn=False)]
    pool = SlotPool(cfg, slots=4, rank_max=8, dtype=torch.float32)
    slots = [pool.load(f"a{i}", w, busy=set()) for i, w in enumerate(ws)]
    # rows: 3 of adapter 0, 2 of the base model, 1 of adapter 2, 2 of adapter 1
    owners = [0, 0, 0, None, None, 2, 1, 1]
    idx = [-1 if o is None else slots[o] for o in owners]
    seg, ids, table = [0, 3, 5, 6, 8], [0, 3, 2, 1], [*ws, LoraWeights(LoraSpec(), {}, {})]
    reference = LoraBatch(seg, ids, table, invariant=False)
    batch = SlotBatch(pool, idx)
    gen = torch.Generator().manual_seed(5)
    checked = 0
    for key in pool.a:
        x = torch.randn(len(owners), pool.a[key].shape[2], generator=gen)
        want, got = reference.delta(key, x), batch.delta(key, x)
        if want is None:
            assert not got.any()
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not got[3:5].any()  # base-model rows
        checked += 1
    assert checked == len(pool.a)
    sub = batch.rows(5, 8)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    torch.testing.assert_close(sub.delta((-1, "lm_head"), x), reference.rows(5, 8).delta((-1, "lm_head"), x),
                               rtol=1e-5, atol=1e-6)


def test_slots_are_lru_never_evicting_busy_ones(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    pool = SlotPool(cfg, slots=2, rank_max=4, dtype=torch.float32)
    a, b, c = (adapter(cfg, 4, s) for s in (1, 2, 3))
    assert (pool.load("a", a, set()), pool.load("b", b, set())) == (0, 1)
    assert pool.load("a", a, set()) == 0 and pool.loads == 2  # resident: no copy, now most recent
    assert pool.load("c", c, busy=set()) == 1 and pool.slot_of("b") is None  # b was least recent
    key = (0, "q_proj")
    assert torch.equal(pool.a[key][1], c.a[key]) and pool.scale[1] == c.spec.scale
    assert pool.load("b", b, busy={1}) == 0 and pool.slot_of("a") is None  # c's slot is busy: a goes
    with pytest.raises(ResourceExhausted, match="all 2 adapter slots are used by running sequences"):
        pool.load("a", a, busy={0, 1})
    with pytest.raises(ValueError, match="has rank 8; this sampler's adapter slots hold rank <= 4"):
        pool.load("big", adapter(cfg, 8, 4), set())
    small = adapter(cfg, 2, 5, train_mlp=False)
    slot = pool.load("small", small, busy={0})
    mlp = (1, "up_proj")
    assert not pool.a[mlp][slot].any() and not pool.b[key][slot][:, 2:].any()  # untrained key and padding: 0


@pytest.mark.processes
def test_triton_bgmv_matches_the_torch_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "bgmv_interpreted.py")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and "1 passed" in summary, run.stdout + run.stderr


def test_place_loads_a_step_without_evicting_what_it_needs(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    pool = SlotPool(cfg, slots=2, rank_max=4, dtype=torch.float32)
    a, b, c = (adapter(cfg, 4, s) for s in (1, 2, 3))
    assert pool.place([("a", a), None, ("b", b), ("a", a)]) == [0, -1, 1, 0]
    pool.load("a", a, set())  # a is now the most recent, b the least
    # c needs a slot: b's goes (least recent), never a's, which this step needs too
    assert pool.place([("c", c), ("a", a)]) == [1, 0] and pool.slot_of("b") is None
    assert pool.place([("a", a), ("b", b), ("c", c)]) is None  # three adapters, two slots
    assert pool.place([("big", adapter(cfg, 8, 4))]) is None  # rank above rank_max
    assert pool.loads == 3


PATHS = ["tinker://run-a/sampler_weights/s1", "tinker://run-b/sampler_weights/s1",
         "tinker://run-c/sampler_weights/s1"]


def _staggered(eng: SamplerEngine) -> list[object]:
    """Requests on adapters a and b (and the base model) decode for 3 steps, then one on adapter c joins:
    three adapters run at once until a's request ends (6 tokens), then b and c run on."""
    first = [eng.sample(request([5, 17, 3, 99, 42], path=PATHS[0], n=2, max_tokens=6, temperature=0.0, seed=None)),
             eng.sample(request([7, 1, 300], path=PATHS[1], max_tokens=14, temperature=0.0, seed=None)),
             eng.sample(request([11, 12], max_tokens=9, temperature=0.0, seed=None))]
    wait_waiting(eng, 3)
    for _ in range(3):
        eng.step()
    late = eng.sample(request(list(range(30, 100)), path=PATHS[2], max_tokens=10, temperature=0.0, seed=None))
    wait_waiting(eng, 1)
    return [ok(r) for r in pump(eng, [*first, late])]


def test_engine_slot_path_matches_the_per_segment_path(model_cache: Path, tiny_dir: Path) -> None:
    runs = {}
    for bgmv in ("off", "torch"):
        eng = make_engine(model_cache, source_for(tiny_dir), invariant=False, bgmv=bgmv, adapter_slots=2)
        runs[bgmv] = _staggered(eng)
        base = eng.base(BASE)
        eng.stop()
        if bgmv == "torch":
            # a and b loaded, then c took a's slot once a's request ended while b's went on
            assert base.slots is not None and base.runner is not None and base.slots.loads == 3
        else:
            assert base.slots is None and base.runner is None
    for ref, got in zip(runs["off"], runs["torch"], strict=True):
        for r, g in zip(ref.sequences, got.sequences, strict=True):
            assert list(g.tokens) == list(r.tokens)
            torch.testing.assert_close(torch.tensor(list(g.logprobs)), torch.tensor(list(r.logprobs)),
                                       rtol=1e-5, atol=1e-5)


def test_invariant_mode_refuses_the_bgmv_path() -> None:
    with pytest.raises(ValueError, match="bgmv 'torch' is the throughput path"):
        SamplerConfig(device="cpu", bgmv="torch")
    with pytest.raises(ValueError, match="bgmv 'triton' needs device 'cuda'"):
        SamplerConfig(device="cpu", invariant=False, bgmv="triton")
    assert SamplerConfig(device="cpu", invariant=False, sgmv=True).decode_bgmv == "off"  # auto: triton on cuda only
    assert SamplerConfig(device="cpu", invariant=False, bgmv="torch").decode_bgmv == "torch"
