"""The native sampler in-process, request by request.

Protects: greedy = argmax of the trainer's logits; stop strings / stop ids / max_tokens / EOS; prompt logprobs
and top-k; request validation; the checkpoint version pin; a broken adapter fails only its own request; the
bounded queue; the threaded engine (exactness against the trainer, the process: test_sampler.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lathe.errors import ResourceExhausted
from lathe.models.decoder import Packed
from lathe.models.lora_batch import LoraBatch
from lathe.sampler.engine import SamplerEngine
from lathe.v1 import lathe_pb2 as pb
from tests.test_sampler import (
    BASE,
    MemorySource,
    adapters,
    lora,
    make_engine,
    ok,
    pump,
    request,
    sample_one,
    source_for,
    trainer_logprobs,
    trainer_model,
    wait_waiting,
)


@pytest.fixture()
def engines(model_cache: Path) -> Iterator[Callable[..., SamplerEngine]]:
    """``engines(source=None, **config)``: engines that are not started (tests drive them with
    ``pump``) and are stopped after the test."""
    made: list[SamplerEngine] = []

    def make(source: MemorySource | None = None, **cfg: object) -> SamplerEngine:
        made.append(make_engine(model_cache, source, **cfg))
        return made[-1]

    yield make
    for eng in made:
        eng.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


# ---------------------------------------------------------------- selection and stopping


def test_greedy_is_argmax_of_trainer_logits(engines: Callable[..., SamplerEngine], tiny_dir: Path) -> None:
    path = "tinker://run-a/sampler_weights/s1"
    w = adapters(tiny_dir)[path]
    model = trainer_model(tiny_dir, "float32", True)
    eng = engines(source_for(tiny_dir))
    prompt = [5, 17, 3, 99, 42]
    out = ok(sample_one(eng, request(prompt, path=path, n=2, max_tokens=12, temperature=0.0, seed=None)))
    full = prompt + list(out.sequences[0].tokens)
    batch = Packed.from_sequences([full[:-1]])
    segs = LoraBatch([0, len(full) - 1], [0], [w])
    with torch.no_grad():
        logits = model.logits(model.hidden(batch, segs), segs)
    assert list(out.sequences[0].tokens) == logits.argmax(-1)[len(prompt) - 1:].tolist()
    assert list(out.sequences[1].tokens) == list(out.sequences[0].tokens)  # greedy ignores the seed
    assert [s.stop_reason for s in out.sequences] == ["length", "length"]
    assert {s.policy_version for s in out.sequences} == {path}


def _greedy(eng: SamplerEngine, prompt: list[int], **params: object) -> pb.SampledSequence:
    return ok(sample_one(eng, request(prompt, temperature=0.0, seed=None, **params))).sequences[0]


def test_stop_token_ids_and_stop_strings_end_with_stop(engines: Callable[..., SamplerEngine],
                                                       tokenizer: Tokenizer) -> None:
    eng = engines()
    prompt = [7, 8, 9, 10, 11]
    free = list(_greedy(eng, prompt, max_tokens=24).tokens)
    assert len(free) == 24
    # stop token id: the sequence ends at the first occurrence, which is kept
    stop_id = free[5]
    seq = _greedy(eng, prompt, max_tokens=24, stop_token_ids=[stop_id])
    assert list(seq.tokens) == free[: free.index(stop_id) + 1] and seq.stop_reason == "stop"


def test_stop_strings_end_at_the_token_that_completes_them(engines: Callable[..., SamplerEngine],
                                                           tokenizer: Tokenizer) -> None:
    """Stop strings taken from the greedy text (2+ characters over 1-3 tokens); the expected cut is
    the first prefix whose full decoding contains the string."""
    eng = engines()

    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=False)

    checked = 0
    for first in range(1, 40, 3):
        prompt = [first, first + 1, first + 2]
        free = list(_greedy(eng, prompt, max_tokens=24).tokens)
        spans = [text(free[j:j + n]) for n in (2, 3, 1) for j in range(2, len(free) - n)]
        usable = [s for s in spans if len(s.strip()) >= 2 and "\ufffd" not in s]
        for stop in usable[:2]:
            end = next(i for i in range(len(free)) if stop in text(free[: i + 1]))
            seq = _greedy(eng, prompt, max_tokens=24, stop_strings=[stop, "never-in-this-text"])
            assert list(seq.tokens) == free[: end + 1], repr(stop)
            assert seq.stop_reason == "stop"
            checked += 1
        if checked >= 4:
            break
    assert checked, "no usable stop string in the greedy texts"


def test_no_eos_and_no_stops_runs_to_max_tokens(engines: Callable[..., SamplerEngine]) -> None:
    eng = engines()
    out = ok(sample_one(eng, request([1, 2, 3], n=3, max_tokens=9, use_eos=False)))
    assert [(len(s.tokens), s.stop_reason) for s in out.sequences] == [(9, "length")] * 3
    assert all(len(s.logprobs) == 9 for s in out.sequences)


def test_eos_stops_only_when_asked(engines: Callable[..., SamplerEngine]) -> None:
    """EOS ends a sequence with use_eos, or alongside stop strings / ids; never with neither."""
    eng = engines()
    prompt = [4, 5, 6]
    free = list(_greedy(eng, prompt, max_tokens=20, use_eos=False).tokens)
    base = eng.base(BASE)  # pretend the model's EOS is a token the greedy text contains
    base.limits = dataclasses.replace(base.limits, eos_ids=(free[4],))

    def upto(stops: set[int]) -> list[int]:
        return free[: next(i for i, t in enumerate(free) if t in stops) + 1]

    seq = _greedy(eng, prompt, max_tokens=20, use_eos=True)
    assert list(seq.tokens) == upto({free[4]}) and seq.stop_reason == "stop"
    assert list(_greedy(eng, prompt, max_tokens=20, stop_token_ids=[free[-1]]).tokens) == upto({free[4], free[-1]})
    assert list(_greedy(eng, prompt, max_tokens=20, use_eos=False).tokens) == free


K = 64


def test_topk_prompt_logprobs_are_sorted_and_hold_the_true_token(engines: Callable[..., SamplerEngine],
                                                                 tiny_dir: Path) -> None:
    path = "tinker://run-b/sampler_weights/s1"
    eng = engines(source_for(tiny_dir))
    prompt = random.Random(3).choices(range(200), k=30)
    req = request(prompt, path=path, max_tokens=1, prompt_logprobs=True)
    req.topk_prompt_logprobs = K
    out = ok(sample_one(eng, req))
    top = out.topk_prompt_logprobs
    assert len(top) == len(prompt) and len(top[0].token_ids) == 0
    found = 0
    for i in range(1, len(prompt)):
        lps = list(top[i].logprobs)
        assert len(lps) == K == len(top[i].token_ids) and lps == sorted(lps, reverse=True)
        if prompt[i] in top[i].token_ids:
            assert lps[list(top[i].token_ids).index(prompt[i])] == out.prompt_logprobs[i]
            found += 1
        else:
            assert out.prompt_logprobs[i] <= lps[-1]
    model = trainer_model(tiny_dir, "float32", True)
    ref = trainer_logprobs(model, adapters(tiny_dir)[path], prompt)
    assert torch.equal(torch.tensor(list(out.prompt_logprobs)[1:]), ref)
    assert 0 < found < len(prompt) - 1  # both branches ran


# ---------------------------------------------------------------- validation, versions, admission

_V = 1 << 30  # stands for the vocabulary size in the cases below


def _bad(mutate: Callable[[pb.SampleRequest], None]) -> pb.SampleRequest:
    req = request([1, 2, 3], path="tinker://run-a/sampler_weights/s1")
    mutate(req)
    return req


BAD_INPUTS = {
    "max_tokens zero": (lambda r: setattr(r.params, "max_tokens", 0), "params.max_tokens = 0 must be >= 1"),
    "max_tokens over context": (lambda r: setattr(r.params, "max_tokens", 10**6), "is over the context length"),
    "no samples": (lambda r: setattr(r, "num_samples", 0), "num_samples = 0 must be in [1, 128]"),
    "too many samples": (lambda r: setattr(r, "num_samples", 129), "num_samples = 129 must be in [1, 128]"),
    "negative temperature": (lambda r: setattr(r.params, "temperature", -0.5), "params.temperature = -0.5"),
    "top_p zero": (lambda r: setattr(r.params, "top_p", 0.0), "params.top_p = 0.0 must be in (0, 1]"),
    "top_p above one": (lambda r: setattr(r.params, "top_p", 1.5), "params.top_p = 1.5 must be in (0, 1]"),
    "empty prompt": (lambda r: r.ClearField("prompt"), "prompt is empty"),
    "prompt over context": (lambda r: r.prompt.extend([1] * 10**5), "tokens, over the context length"),
    "token above vocab": (lambda r: r.prompt.append(_V), "prompt[3] = "),
    "negative token": (lambda r: r.prompt.insert(0, -1), "prompt[0] = -1 is outside the vocabulary"),
    "stop id above vocab": (lambda r: r.params.stop_token_ids.append(_V), "params.stop_token_ids[0] = "),
    "empty stop string": (lambda r: r.params.stop_strings.append(""), "params.stop_strings[0] is empty"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_rejected_with_its_message(engines: Callable[..., SamplerEngine], tiny_dir: Path,
                                                name: str) -> None:
    mutate, fragment = BAD_INPUTS[name]
    vocab = trainer_model(tiny_dir, "float32", True).cfg.vocab_size
    req = _bad(mutate)
    for i, t in enumerate(req.prompt):
        if t == _V:
            req.prompt[i] = vocab
    for i, t in enumerate(req.params.stop_token_ids):
        if t == _V:
            req.params.stop_token_ids[i] = vocab
    source = source_for(tiny_dir)
    eng = engines(source)
    res = eng.sample(req).result(timeout=60)
    assert res.WhichOneof("result") == "error"
    assert res.error.code == "InvalidArgument" and res.error.category == "user"
    assert fragment in res.error.message, res.error.message
    assert eng.stats() == {"queued": 0, "waiting": 0, "running": 0, "adapters": 0, "steps": 0}
    assert source.fetches == 0


def test_unknown_base_model_is_not_found(engines: Callable[..., SamplerEngine]) -> None:
    eng = engines()
    req = request([1, 2])
    req.base_model = "no/such-model"
    res = eng.sample(req).result(timeout=60)
    assert res.error.code == "NotFound" and "no/such-model" in res.error.message


def test_overwritten_checkpoint_is_refused(engines: Callable[..., SamplerEngine], tiny_dir: Path) -> None:
    path = "tinker://run-a/sampler_weights/s1"
    source = source_for(tiny_dir)
    bound = request([3, 4, 5], path=path, max_tokens=4, seed=9)
    warm = engines(source)
    before = ok(sample_one(warm, bound))
    source.put(path, lora(trainer_model(tiny_dir, "float32", True), 2, 77), version=200.0)  # overwritten
    cold = engines(source)
    res = cold.sample(bound).result(timeout=60)
    assert res.error.code == "FailedPrecondition"
    assert f"the checkpoint at {path} was overwritten after this sampling client was bound" in res.error.message
    # an engine still holding the bound version serves exactly it, never the newer weights
    assert ok(sample_one(warm, bound)) == before
    rebound = request([3, 4, 5], path=path, max_tokens=4, seed=9)
    rebound.model_version = 200.0
    assert ok(sample_one(cold, rebound)).sequences[0].logprobs != before.sequences[0].logprobs


def test_a_broken_adapter_fails_only_its_own_request(engines: Callable[..., SamplerEngine], tiny_dir: Path) -> None:
    source = source_for(tiny_dir)
    broken = lora(trainer_model(tiny_dir, "float32", True), 2, 5)
    with torch.no_grad():
        next(iter(broken.b.values()))[0, 0] = float("nan")
    source.put("tinker://broken/sampler_weights/s", broken, version=100.0)
    eng = engines(source)
    futs = [eng.sample(request([1, 2, 3], path=p, max_tokens=4))
            for p in ("tinker://broken/sampler_weights/s", "tinker://run-a/sampler_weights/s1")]
    wait_waiting(eng, 2)
    bad, good = pump(eng, futs)
    assert bad.error.code == "Internal" and "non-finite logits" in bad.error.message
    assert len(ok(good).sequences[0].tokens) == 4 and good.receipt.cycle == bad.receipt.cycle


def test_full_queue_is_resource_exhausted_and_stop_fails_the_rest(engines: Callable[..., SamplerEngine]) -> None:
    eng = engines(max_queue=2)  # never stepped: nothing leaves the queue
    futs = [eng.sample(request([1, 2, 3])) for _ in range(2)]
    with pytest.raises(ResourceExhausted) as exc:
        eng.sample(request([1, 2, 3]))
    assert exc.value.retry_after_s and "queue is full" in exc.value.message
    eng.stop()
    assert [f.result(timeout=10).error.code for f in futs] == ["Unavailable", "Unavailable"]


def test_threaded_engine_serves_concurrent_requests(engines: Callable[..., SamplerEngine], tiny_dir: Path) -> None:
    eng = engines(source_for(tiny_dir), max_running=4)
    eng.start()
    futs = [eng.sample(request([i + 1, 2, 3], path=p, n=2, max_tokens=5))
            for i, p in enumerate([""] + list(adapters(tiny_dir)) * 2)]
    results = [f.result(timeout=120) for f in futs]
    for res in results:
        out = ok(res)
        assert [len(s.tokens) for s in out.sequences] == [5, 5]
        assert res.receipt.op == "sample" and res.receipt.dtype == "float32" and res.receipt.tokens == 3 + 10
        assert res.receipt.request_id.startswith("req-")
