"""The native sampler in-process, against the trainer's own forward pass.

Protects: the logprob reported for every sampled token is bitwise the trainer's forward logprob for
the same token, whatever the batch (one request alone vs. many adapters and lengths with prefill
and decode mixed in one step), in fp32 and bf16; plain ops do break that (so the check can fail);
seeded sampling is batch-independent; prompt logprobs; the sampler process over gRPC; and the selection
rules and adapter cache on their own (greedy, stops, top-k, validation, versions and the queue:
test_sampler_requests.py; the KV cache: test_paged_kv.py).
"""

from __future__ import annotations

import functools
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
import torch

from lathe.errors import NotFound
from lathe.models.catalog import ModelCatalog
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.pool import DTYPES
from lathe.models.tiny import ensure_tiny_model
from lathe.runtime.serving import READY_MARK
from lathe.sampler.adapters import AdapterCache
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.sampler.sampling import Rule, choose, generator
from lathe.trainer.bank import Adapter
from lathe.trainer.optimizer import AdamState
from lathe.trainer.step import Job, run_jobs
from lathe.trainer.validate import Example
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc
from tests.helpers import CrossDtype

torch.set_num_threads(1)
BASE = "lathe/tiny-llama"
MOE = "lathe/tiny-qwen3-moe"
TENANT = "t"


# ---------------------------------------------------------------- fixtures and helpers


class MemorySource:
    """An ``AdapterSource`` over a dict: (tenant, path) -> (files, version); counts fetches."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], tuple[dict[str, bytes], float]] = {}
        self.fetches = 0

    def put(self, path: str, weights: LoraWeights, version: float, base: str = BASE) -> None:
        state = Adapter(path, TENANT, base, weights, AdamState.zeros(weights.named_parameters()))
        self.items[(TENANT, path)] = (state.sampler_files(), version)

    def get(self, tenant: str, path: str) -> tuple[dict[str, bytes], float]:
        self.fetches += 1
        if (tenant, path) not in self.items:
            raise NotFound(f"no checkpoint at {path}")
        return self.items[(tenant, path)]


def lora(model: Decoder, rank: int, seed: int, **targets: bool) -> LoraWeights:
    """An adapter with random A and random non-zero B (so it changes the logprobs)."""
    w = LoraWeights.init(model.cfg, LoraSpec(rank=rank, **targets), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in w.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    return w


@functools.cache
def trainer_model(model_dir: Path, dtype: str, invariant: bool) -> Decoder:
    return Decoder.from_dir(model_dir, dtype=DTYPES[dtype], invariant=invariant)


@functools.cache
def adapters(model_dir: Path) -> dict[str, LoraWeights]:
    """Sampler-weights paths -> adapters: different ranks and target sets."""
    m = trainer_model(model_dir, "float32", True)
    return {
        "tinker://run-a/sampler_weights/s1": lora(m, 2, 11),
        "tinker://run-b/sampler_weights/s1": lora(m, 4, 12, train_mlp=False),
        "tinker://run-c/sampler_weights/s1": lora(m, 8, 13, train_attn=False, train_unembed=False),
    }


def source_for(model_dir: Path, base: str = BASE) -> MemorySource:
    src = MemorySource()
    for path, w in adapters(model_dir).items():
        src.put(path, w, version=100.0, base=base)
    return src


def trainer_logprobs(model: Decoder, weights: LoraWeights | None, tokens: list[int]) -> torch.Tensor:
    """The trainer's forward logprobs ``[len(tokens) - 1]`` of tokens[1:] (base model: a B = 0 adapter)."""
    w = weights if weights is not None else LoraWeights.init(model.cfg, LoraSpec(rank=1), seed=0)
    ex = Example(tokens[:-1], torch.tensor(tokens[1:]), {"weights": torch.ones(len(tokens) - 1)})
    return run_jobs(model, [Job(w, [ex], "cross_entropy", {}, backward=False)])[0].logprobs[0]


def request(prompt: list[int], *, path: str = "", n: int = 1, max_tokens: int = 8, seed: int | None = 1,
            temperature: float = 1.0, prompt_logprobs: bool = False, top_p: float = 1.0, base: str = BASE,
            **params: object) -> pb.SampleRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, **params)
    if seed is not None:
        sp.seed = seed
    return pb.SampleRequest(prompt=prompt, num_samples=n, params=sp, prompt_logprobs=prompt_logprobs,
                            tenant=TENANT, base_model=base, model_path=path,
                            model_version=100.0 if path else 0.0, request_id=f"req-{random.random()}")


def make_engine(model_cache: Path, source: MemorySource | None = None, base: str = BASE,
                **cfg: object) -> SamplerEngine:
    cfg.setdefault("max_running", 64)
    return SamplerEngine(SamplerConfig(models=base, cache_root=model_cache, **cfg),
                         ModelCatalog.from_spec(base, model_cache), source)


def wait_waiting(eng: SamplerEngine, n: int, timeout: float = 60.0) -> None:
    """Block until ``n`` requests passed their checks and wait for admission."""
    deadline = time.monotonic() + timeout
    while eng.stats()["waiting"] < n:
        assert time.monotonic() < deadline, f"requests never reached the waiting line: {eng.stats()}"
        time.sleep(0.001)


def pump(eng: SamplerEngine, futures: list[Future], timeout: float = 120.0) -> list[pb.SampleResult]:
    """Drive an engine that was not started: run steps until every future is resolved."""
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "sampling did not finish"
        if eng.step() == 0:
            time.sleep(0.001)
    return [f.result() for f in futures]


def ok(res: pb.SampleResult) -> pb.SampleOutput:
    assert res.WhichOneof("result") == "sample", res.error
    return res.sample


def sample_one(eng: SamplerEngine, req: pb.SampleRequest) -> pb.SampleResult:
    return pump(eng, [eng.sample(req)])[0]


# ---------------------------------------------------------------- exactness against the trainer


def _workload(vocab: int, base: str) -> list[pb.SampleRequest]:
    """Requests over three adapters and the base model, with different prompt lengths and sizes."""
    rng = random.Random(5)
    paths = ["", "tinker://run-a/sampler_weights/s1", "tinker://run-b/sampler_weights/s1",
             "tinker://run-c/sampler_weights/s1"]
    reqs = []
    for i in range(8):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 7, 18, 40, 70]))]
        reqs.append(request(prompt, path=paths[i % 4], n=1 + i % 3, max_tokens=6 + i % 5, seed=100 + i,
                            top_k=[0, 40][i % 2], top_p=[1.0, 0.95][i % 3 == 0], prompt_logprobs=i % 2 == 0,
                            base=base))
    return reqs


@functools.cache
def _runs(model_cache: Path, model_dir: Path, dtype: str, invariant: bool, base: str = BASE
          ) -> tuple[list[pb.SampleRequest], list[pb.SampleOutput], list[pb.SampleOutput]]:
    """The workload run one request at a time, and run busy: four requests, three steps later the
    other four arrive (their prefills share steps with the first four's decodes)."""
    eng = make_engine(model_cache, source_for(model_dir, base), base, dtype=dtype, invariant=invariant)
    reqs = _workload(trainer_model(model_dir, dtype, invariant).cfg.vocab_size, base)
    alone = [ok(sample_one(eng, r)) for r in reqs]
    first = [eng.sample(r) for r in reqs[:4]]
    wait_waiting(eng, 4)
    for _ in range(3):
        eng.step()
    second = [eng.sample(r) for r in reqs[4:]]
    wait_waiting(eng, 4)
    busy = pump(eng, first + second)
    start = busy[0].receipt.cycle  # the first four were prefilled together, the others 3 steps later,
    assert [r.receipt.cycle for r in busy] == [start] * 4 + [start + 3] * 4  # in the middle of their decoding
    assert min(q.params.max_tokens for q in reqs[:4]) > 3
    if invariant:  # the adapters' ranks (2, 4 and the self-check's 8) were each checked before their first step
        report = eng.exactness.reports[base]
        assert report.ranks == [2, 4, 8] and report.exact, report.first_failure
    eng.stop()
    return reqs, alone, [ok(r) for r in busy]


def _mismatches(model_cache: Path, model_dir: Path, dtype: str, invariant: bool, base: str = BASE
                ) -> tuple[int, int]:
    """(tokens whose sampled logprob differs from the trainer's, tokens compared)."""
    reqs, alone, busy = _runs(model_cache, model_dir, dtype, invariant, base)
    model = trainer_model(model_dir, dtype, invariant)
    ads = adapters(model_dir)
    bad = total = 0
    for req, outs in zip(reqs * 2, alone + busy, strict=True):
        for seq in outs.sequences:
            full = list(req.prompt) + list(seq.tokens)
            ref = trainer_logprobs(model, ads.get(req.model_path), full)[len(req.prompt) - 1:]
            got = torch.tensor(list(seq.logprobs), dtype=torch.float32)
            bad += int((got != ref).sum())
            total += len(seq.tokens)
    return bad, total


@pytest.mark.parametrize("base", [BASE, MOE])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_logprobs_equal_trainer_forward_bitwise(model_cache: Path, tiny_dir: Path, dtype: str,
                                                        base: str) -> None:
    """Every sampled token's logprob is the trainer's, alone and busy, on the tiny dense model and on the tiny
    Qwen3-MoE (whose routing then is the trainer's for every token too)."""
    model_dir = tiny_dir if base == BASE else ensure_tiny_model(model_cache, "qwen3_moe")
    bad, total = _mismatches(model_cache, model_dir, dtype, invariant=True, base=base)
    assert total > 100
    assert bad == 0, f"{bad}/{total} sampled logprobs differ from the trainer's"


def test_a_bf16_pool_samples_without_ops_across_dtypes(model_cache: Path, tiny_dir: Path) -> None:
    """Prefill and decode steps of a bf16 pool meet the fp32 LoRA only through casts (the LM head's correction was
    once added to the bf16 logits across dtypes, several times slower than an upcast and an fp32 add)."""
    with CrossDtype() as mode:
        _runs(model_cache, tiny_dir, "bfloat16", True)
    assert mode.seen == []


@pytest.mark.canary
def test_plain_ops_break_exactness(model_cache: Path, tiny_dir: Path) -> None:
    """The same comparison with invariant=False on both sides: some logprob differs."""
    bad, total = _mismatches(model_cache, tiny_dir, "float32", invariant=False)
    assert bad > 0, f"all {total} logprobs matched with plain ops: the exactness test cannot fail"


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(model_cache: Path, tiny_dir: Path) -> None:
    reqs, alone, busy = _runs(model_cache, tiny_dir, "float32", True)
    for req, a, b in zip(reqs, alone, busy, strict=True):
        assert [list(s.tokens) for s in a.sequences] == [list(s.tokens) for s in b.sequences]
        assert len(a.sequences) == req.num_samples
    multi = [a for a in alone if len(a.sequences) > 1]
    assert any(len({tuple(s.tokens) for s in a.sequences}) > 1 for a in multi), "samples of a request are all equal"


def test_prompt_logprobs_equal_trainer_forward(model_cache: Path, tiny_dir: Path) -> None:
    reqs, alone, busy = _runs(model_cache, tiny_dir, "float32", True)
    model = trainer_model(tiny_dir, "float32", True)
    checked = 0
    for req, out in zip(reqs * 2, alone + busy, strict=True):
        if not req.prompt_logprobs:
            assert len(out.prompt_logprobs) == 0
            continue
        lp = list(out.prompt_logprobs)
        assert len(lp) == len(req.prompt) and math.isnan(lp[0])
        if len(req.prompt) > 1:
            ref = trainer_logprobs(model, adapters(tiny_dir).get(req.model_path), list(req.prompt))
            assert torch.equal(torch.tensor(lp[1:], dtype=torch.float32), ref)
            checked += 1
    assert checked >= 4


# ---------------------------------------------------------------- the process


def test_sampler_process_serves_grpc(model_cache: Path, tiny_dir: Path) -> None:
    """``python -m lathe.sampler`` prints its ready line, answers Capabilities and Sample (per-request
    problems as an Error result), and stops cleanly on SIGTERM."""
    cmd = [sys.executable, "-m", "lathe.sampler", "--port", "0", "--models", BASE, "--cache-root", str(model_cache),
           "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        for x in proc.stdout:
            lines.put(x)

    threading.Thread(target=drain, daemon=True).start()
    try:
        line = ""
        while READY_MARK not in line:
            line = lines.get(timeout=120)
        with grpc.insecure_channel(line.rsplit(READY_MARK, 1)[1].strip()) as channel:
            stub = pb_grpc.SamplerStub(channel)
            caps = stub.Capabilities(pb.TrainerCapabilitiesRequest(), timeout=30)
            assert BASE in [m.model_name for m in caps.supported_models]
            res = stub.Sample(request([1, 2, 3], n=2, max_tokens=5), timeout=60)
            assert [len(s.tokens) for s in ok(res).sequences] == [5, 5]
            assert stub.Sample(request([]), timeout=60).error.code == "InvalidArgument"
            res = stub.Sample(request([1, 2], path="tinker://run-a/sampler_weights/s1"), timeout=60)
            assert res.error.code == "FailedPrecondition" and "no checkpoint store" in res.error.message
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0


# ---------------------------------------------------------------- parts on their own


def test_selection_rules() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0, 0.5])
    g = generator(1, 0)
    assert choose(logits, Rule(temperature=0.0), g) == 1
    assert {choose(logits, Rule(temperature=5.0, top_k=1), g) for _ in range(20)} == {1}
    assert {choose(logits, Rule(temperature=5.0, top_p=0.01), g) for _ in range(20)} == {1}
    assert {choose(logits, Rule(temperature=5.0, top_k=2), g) for _ in range(50)} == {1, 2}
    draws = [choose(logits, Rule(temperature=1.0), generator(7, i)) for i in range(16)]
    assert draws == [choose(logits, Rule(temperature=1.0), generator(7, i)) for i in range(16)]
    assert len(set(draws)) > 1


def test_adapter_cache_is_lru_and_versioned(tiny_dir: Path) -> None:
    cfg = trainer_model(tiny_dir, "float32", True).cfg
    source = source_for(tiny_dir)
    cache = AdapterCache(source, capacity=2)
    paths = list(adapters(tiny_dir))
    got = [cache.get(TENANT, p, 100.0, cfg, torch.bfloat16, BASE) for p in paths]
    assert source.fetches == 3 and len(cache) == 2
    assert cache.get(TENANT, paths[2], 100.0, cfg, torch.bfloat16, BASE) is got[2] and source.fetches == 3
    cache.get(TENANT, paths[0], 100.0, cfg, torch.bfloat16, BASE)  # evicted before: fetched again
    assert source.fetches == 4
    w = adapters(tiny_dir)[paths[1]]
    assert all(torch.equal(got[1].b[k], w.b[k].detach().to(torch.bfloat16)) for k in w.b)
    assert got[1].spec == LoraSpec(rank=4, train_mlp=False)


def test_the_sampler_refuses_a_config_value_as_a_usage_error() -> None:
    bad = subprocess.run([sys.executable, "-m", "lathe.sampler", "--kv-blocks", "1"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "error: kv_blocks must be 0 (derived) or >= 2 (one is the null block), got 1" \
        in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
