"""The sampler's logprob options against a plain full forward of the same model, and through both SDKs.

Protects: ``topk_sample_logprobs`` (each sampled token's row, its own logprob among them bit for bit),
``prompt_logprobs_last_n`` (only the suffix scored, with the bits of a whole-prompt request),
``target_prompt_logprobs`` (the asked ids' logprobs, 0.0 for -1) and ``prompt_alt_tokens_k`` (draws that
follow the tempered distribution, are argmax at temperature 0, repeat under a seed, and carry their
logprobs); every number is compared with one unpacked forward of the whole sequence, and a request gives the
same result alone and in a busy batch; the checks of each option name the field and value; and the official
``tinker`` SDK (HTTP door, a sparse ``target_prompt_logprobs``, ``record_stability_info``) and Lathe's SDK (gRPC
door) get the same bits for the same seeded request, equal to the reference; the door bounds each width the
way it bounds a top-k, and reads target ids sent dense or sparse.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from test_sampler import (
    adapters,
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

import lathe
from lathe.errors import InvalidArgument
from lathe.gateway.json_fields import Fields
from lathe.gateway.limits import RequestLimits
from lathe.gateway.tinker_json import sample_request
from lathe.kernels import ops
from lathe.models.decoder import Decoder, Packed
from lathe.models.lora import LoraWeights
from lathe.models.lora_batch import LoraBatch
from lathe.sampler.engine import SamplerEngine
from lathe.stack import Stack
from lathe.types import TensorData
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import tensor_from_proto, tensor_to_proto

PATH = "tinker://run-a/sampler_weights/s1"
BASE = "lathe/tiny-llama"


@pytest.fixture()
def eng(model_cache: Path, tiny_dir: Path) -> Iterator[SamplerEngine]:
    """An engine serving the test adapters, not started (tests drive it with ``pump``)."""
    engine = make_engine(model_cache, source_for(tiny_dir))
    yield engine
    engine.stop()


def full_rows(model: Decoder, w: LoraWeights | None, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, logprobs) ``[len(tokens), V]`` of one unpacked forward: row j predicts ``tokens[j + 1]``."""
    segs = LoraBatch([0, len(tokens)], [0], [w]) if w is not None else None
    with torch.no_grad():
        logits = model.logits(model.hidden(Packed.from_sequences([tokens]), segs), segs)
    return logits, ops.log_softmax(logits, dim=-1, invariant=model.invariant)


def array(t: pb.Tensor) -> np.ndarray:
    return tensor_from_proto(t).to_numpy()


def prompt_of(n: int, seed: int, vocab: int = 200) -> list[int]:
    return random.Random(seed).choices(range(vocab), k=n)


def test_topk_sample_logprobs_are_the_rows_of_the_full_forward(eng: SamplerEngine, tiny_dir: Path) -> None:
    model, w = trainer_model(tiny_dir, "float32", True), adapters(tiny_dir)[PATH]
    prompt, k = prompt_of(9, 1), 5
    for temperature in (0.0, 1.0):
        req = request(prompt, path=PATH, n=2, max_tokens=7, temperature=temperature)
        req.topk_sample_logprobs = k
        out = ok(sample_one(eng, req))
        for seq in out.sequences:
            tokens = list(seq.tokens)
            _, lp = full_rows(model, w, prompt + tokens)
            rows = lp[len(prompt) - 1:-1]
            ref = torch.topk(rows, k, dim=-1)
            assert len(seq.topk_logprobs) == len(tokens)
            assert [list(e.token_ids) for e in seq.topk_logprobs] == ref.indices.tolist()
            assert torch.equal(torch.tensor([list(e.logprobs) for e in seq.topk_logprobs]), ref.values)
            # the sampled token's own entry is its reported logprob, which is the trainer's
            assert torch.equal(torch.tensor(list(seq.logprobs)), trainer_logprobs(model, w, prompt + tokens)
                               [len(prompt) - 1:])
            own = [(list(e.token_ids).index(t), e, lp_t) for e, t, lp_t in
                   zip(seq.topk_logprobs, tokens, seq.logprobs, strict=True) if t in e.token_ids]
            assert all(e.logprobs[i] == lp_t for i, e, lp_t in own)
            if temperature == 0.0:
                assert len(own) == len(tokens) and all(i == 0 for i, _, _ in own)


def test_prompt_logprobs_last_n_scores_only_the_suffix_with_the_same_bits(eng: SamplerEngine, tiny_dir: Path) -> None:
    model, w = trainer_model(tiny_dir, "float32", True), adapters(tiny_dir)[PATH]
    prompt = prompt_of(300, 2)  # more rows than one logits chunk
    whole = request(prompt, path=PATH, max_tokens=1, prompt_logprobs=True)
    whole.topk_prompt_logprobs = 3
    ref = trainer_logprobs(model, w, prompt)
    full = ok(sample_one(eng, whole))
    for last_n in (1, 7, 299):
        req = request(prompt, path=PATH, max_tokens=1, prompt_logprobs=True)
        req.topk_prompt_logprobs, req.prompt_logprobs_last_n = 3, last_n
        out = ok(sample_one(eng, req))
        lps = torch.tensor(list(out.prompt_logprobs))
        assert len(lps) == len(prompt) and bool(lps[:-last_n].isnan().all())
        assert torch.equal(lps[-last_n:], ref[-last_n:])
        assert all(len(e.token_ids) == 0 for e in out.topk_prompt_logprobs[:-last_n])
        assert list(out.topk_prompt_logprobs[-last_n:]) == list(full.topk_prompt_logprobs[-last_n:])


def test_target_prompt_logprobs_gather_the_full_forward(eng: SamplerEngine, tiny_dir: Path) -> None:
    model, w = trainer_model(tiny_dir, "float32", True), adapters(tiny_dir)[PATH]
    vocab = model.cfg.vocab_size
    prompt = prompt_of(40, 3)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (len(prompt) - 1, 4), generator=gen)
    ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
    ids[:5] = -1  # rows before the first named id are not computed, and read 0.0
    req = request(prompt, path=PATH, max_tokens=2)
    req.target_prompt_logprobs.CopyFrom(tensor_to_proto(TensorData.from_torch(ids)))
    out = ok(sample_one(eng, req))
    _, lp = full_rows(model, w, prompt)
    ref = lp[:-1].gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
    got = array(out.target_prompt_logprobs)
    assert out.target_prompt_logprobs.dtype == "float32" and got.shape == tuple(ids.shape)
    assert torch.equal(torch.from_numpy(got), ref)
    assert not (got[ids.numpy() >= 0] == 0.0).any()  # every asked cell was computed
    assert len(out.prompt_logprobs) == 0 and not out.HasField("prompt_alt_tokens")  # nothing else asked


def test_prompt_alt_tokens_follow_the_tempered_distribution(eng: SamplerEngine, tiny_dir: Path) -> None:
    model, w = trainer_model(tiny_dir, "float32", True), adapters(tiny_dir)[PATH]
    prompt, k = prompt_of(4, 4), 3000
    logits, lp = full_rows(model, w, prompt)
    for temperature in (0.5, 1.3):
        req = request(prompt, path=PATH, max_tokens=1, temperature=temperature)
        req.prompt_alt_tokens_k = k
        out = ok(sample_one(eng, req))
        tokens, lps = array(out.prompt_alt_tokens.tokens), array(out.prompt_alt_tokens.logprobs)
        assert tokens.shape == lps.shape == (len(prompt) - 1, k)
        assert torch.equal(torch.from_numpy(lps), lp[:-1].gather(1, torch.from_numpy(tokens)))
        probs = torch.softmax(logits[:-1].double() / temperature, dim=-1).numpy()
        for row in range(len(prompt) - 1):
            freq = np.bincount(tokens[row], minlength=probs.shape[1]) / k
            p = probs[row]
            assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / k) + 1 / k).all()
    greedy = request(prompt, path=PATH, max_tokens=1, temperature=0.0, seed=None)
    greedy.prompt_alt_tokens_k = 2
    out = ok(sample_one(eng, greedy))
    assert array(out.prompt_alt_tokens.tokens).tolist() == [[t, t] for t in logits[:-1].argmax(-1).tolist()]


def test_every_option_is_the_same_alone_and_in_a_busy_batch(eng: SamplerEngine, tiny_dir: Path) -> None:
    vocab = trainer_model(tiny_dir, "float32", True).cfg.vocab_size
    prompt = prompt_of(30, 5)
    req = request(prompt, path=PATH, n=2, max_tokens=6, seed=9, prompt_logprobs=True)
    req.topk_prompt_logprobs, req.prompt_logprobs_last_n, req.topk_sample_logprobs = 4, 10, 3
    req.prompt_alt_tokens_k = 5
    ids = torch.randint(-1, vocab, (len(prompt) - 1, 3), generator=torch.Generator().manual_seed(5))
    req.target_prompt_logprobs.CopyFrom(tensor_to_proto(TensorData.from_torch(ids)))
    alone = ok(sample_one(eng, req))
    assert ok(sample_one(eng, req)) == alone  # the seed fixes the draws too
    others = [request(prompt_of(n, n), path=p, n=2, max_tokens=9, seed=n)
              for n, p in ((12, ""), (50, "tinker://run-b/sampler_weights/s1"), (3, PATH))]
    first = [eng.sample(r) for r in others]
    wait_waiting(eng, 3)
    for _ in range(2):
        eng.step()
    busy = pump(eng, [*first, eng.sample(req)])[-1]
    assert ok(busy) == alone


_V = 1 << 30  # stands for the vocabulary size


def _with_targets(rows_delta: int = 0, dtype: str = "int64", fill: int = 5) -> Callable[[pb.SampleRequest], None]:
    def mutate(r: pb.SampleRequest) -> None:
        ids = np.full((len(r.prompt) - 1 + rows_delta, 2), fill, dtype=np.int64)
        r.target_prompt_logprobs.CopyFrom(tensor_to_proto(TensorData.from_numpy(ids.astype(dtype))))
    return mutate


BAD_OPTIONS = {
    "last_n without prompt logprobs": (lambda r: setattr(r, "prompt_logprobs_last_n", 1),
                                       "prompt_logprobs_last_n = 1 needs prompt_logprobs"),
    "last_n zero": (lambda r: (setattr(r, "prompt_logprobs", True), setattr(r, "prompt_logprobs_last_n", 0)),
                    "prompt_logprobs_last_n = 0 must be in [1, 2]"),
    "last_n the whole prompt": (lambda r: (setattr(r, "prompt_logprobs", True),
                                           setattr(r, "prompt_logprobs_last_n", 3)),
                                "prompt_logprobs_last_n = 3 must be in [1, 2]"),
    "topk_sample above vocab": (lambda r: setattr(r, "topk_sample_logprobs", _V), "topk_sample_logprobs = "),
    "alt k negative": (lambda r: setattr(r, "prompt_alt_tokens_k", -2), "prompt_alt_tokens_k = -2 must be >= 0"),
    "targets one row short": (_with_targets(-1), "shape [1, 2]; it must be int64 token ids of shape"),
    "targets of floats": (_with_targets(dtype="float32"), "dtype 'float32'"),
    "target id above vocab": (_with_targets(fill=_V), "target_prompt_logprobs[0, 0] = "),
    "target id below -1": (_with_targets(fill=-2), "target_prompt_logprobs[0, 0] = -2 is neither -1 nor"),
    "targets name nothing": (_with_targets(fill=-1), "target_prompt_logprobs names no token id"),
}


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_bad_options_are_refused_by_name(eng: SamplerEngine, tiny_dir: Path, name: str) -> None:
    mutate, fragment = BAD_OPTIONS[name]
    vocab = trainer_model(tiny_dir, "float32", True).cfg.vocab_size
    req = request([1, 2, 3], path=PATH)
    mutate(req)
    if req.topk_sample_logprobs == _V:
        req.topk_sample_logprobs = vocab + 1
    if req.HasField("target_prompt_logprobs") and array(req.target_prompt_logprobs).flat[0] == _V:
        req.target_prompt_logprobs.CopyFrom(tensor_to_proto(TensorData.from_numpy(
            np.full((2, 2), vocab, dtype=np.int64))))
    res = eng.sample(req).result(timeout=60)
    assert res.WhichOneof("result") == "error" and res.error.code == "InvalidArgument"
    assert fragment in res.error.message, res.error.message


def test_both_sdks_get_every_option_bit_for_bit(stack: Stack, tiny_dir: Path) -> None:
    model = trainer_model(tiny_dir, "float32", True)
    prompt, k = prompt_of(12, 6), 3
    ids = torch.full((len(prompt) - 1, 4), -1, dtype=torch.int64)
    ids[4, 1], ids[9, 0], ids[10, 3] = 17, 3, prompt[11]
    asked = tinker.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert asked.sparse_crow_indices is not None  # the official SDK sends it sparse
    options = {"include_prompt_logprobs": True, "topk_prompt_logprobs": 2, "topk_sample_logprobs": k,
               "prompt_alt_tokens_k": 4, "prompt_logprobs_last_n": 5}
    params = {"max_tokens": 6, "seed": 21, "temperature": 0.8, "stop": []}
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-options")
    lc = lathe.ServiceClient(base_url=stack.gateway, api_key="tml-options")
    ts = sc.create_sampling_client(base_model=BASE, record_stability_info=True).result()
    ls = lc.create_sampling_client(base_model=BASE)
    t = ts.sample(tinker.ModelInput.from_ints(prompt), 2, tinker.SamplingParams(**params),
                  target_prompt_logprobs=asked, **options).result()
    o = ls.sample(lathe.ModelInput.from_ints(prompt), 2, lathe.SamplingParams(**params),
                  target_prompt_logprobs=lathe.TensorData.from_torch(ids), **options).result()

    assert [(s.tokens, s.logprobs, s.topk_logprobs) for s in t.sequences] == \
        [(s.tokens, s.logprobs, s.topk_logprobs) for s in o.sequences]
    assert t.prompt_logprobs == o.prompt_logprobs and t.topk_prompt_logprobs == o.topk_prompt_logprobs
    assert t.target_prompt_logprobs.sparse_col_indices == asked.sparse_col_indices  # answered in its layout
    assert np.array_equal(t.target_prompt_logprobs.to_numpy(), o.target_prompt_logprobs.to_numpy())
    assert np.array_equal(t.prompt_alt_tokens.tokens.to_numpy(), o.prompt_alt_tokens.tokens.to_numpy())
    assert np.array_equal(t.prompt_alt_tokens.logprobs.to_numpy(), o.prompt_alt_tokens.logprobs.to_numpy())

    _, lp = full_rows(model, None, prompt)
    assert t.prompt_logprobs[:-5] == [None] * 7 and t.topk_prompt_logprobs[:-5] == [None] * 7
    assert torch.equal(torch.tensor(t.prompt_logprobs[-5:]), lp[-6:-1].gather(1, torch.tensor(prompt[-5:])[:, None])
                       .squeeze(1))
    assert torch.equal(o.target_prompt_logprobs.to_torch(),
                       lp[:-1].gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0))
    for seq in t.sequences:
        _, rows = full_rows(model, None, prompt + seq.tokens)
        top = torch.topk(rows[len(prompt) - 1:-1], k, dim=-1)
        assert seq.topk_logprobs == [list(zip(i, v, strict=True))
                                     for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    full = prompt + t.sequences[0].tokens
    scored = ts.compute_logprobs(tinker.ModelInput.from_ints(full), prompt_logprobs_last_n=3).result()
    assert scored == ls.compute_logprobs(lathe.ModelInput.from_ints(full), prompt_logprobs_last_n=3).result()
    assert scored[-3:] == t.sequences[0].logprobs[-3:] and scored[:-3] == [None] * (len(full) - 3)
    sc.close("success").result()
    lc.close()


def _ids_tensor(ids: np.ndarray) -> pb.Tensor:
    return tensor_to_proto(TensorData.from_numpy(ids.astype(np.int64)))


def test_the_door_bounds_every_width_like_topk() -> None:
    limits = RequestLimits()
    width = limits.max_topk_prompt_logprobs
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        limits.check_sample(pb.SampleRequest(num_samples=1, **{name: width}))
        with pytest.raises(InvalidArgument, match=f"{name} = {width + 1} must be in \\[0, {width}\\]"):
            limits.check_sample(pb.SampleRequest(num_samples=1, **{name: width + 1}))
    ids = np.full((30, width + 1), -1)
    ids[np.arange(width), np.arange(width)] = np.arange(width) + 100  # width distinct ids in many cells
    ids[20:, 0] = 100
    limits.check_sample(pb.SampleRequest(num_samples=1, target_prompt_logprobs=_ids_tensor(ids)))
    ids[29, width] = 7
    with pytest.raises(InvalidArgument, match=f"names {width + 1} distinct token ids, over the limit of {width}"):
        limits.check_sample(pb.SampleRequest(num_samples=1, target_prompt_logprobs=_ids_tensor(ids)))
    with pytest.raises(InvalidArgument, match="target_prompt_logprobs has 12 cells, over the limit of 10"):
        RequestLimits(max_tensor_elements=10).check_sample(
            pb.SampleRequest(num_samples=1, target_prompt_logprobs=_ids_tensor(np.zeros((3, 4)))))


def _asample(target: object) -> dict:
    return {"sampling_session_id": "s", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {}, "target_prompt_logprobs": target}


def test_the_http_door_reads_target_ids_dense_or_sparse() -> None:
    dense, layout = sample_request(Fields(_asample({"data": [5, -1, -1, 9], "dtype": "int64", "shape": [2, 2]})), 100)
    assert layout is None and array(dense.target_prompt_logprobs).tolist() == [[5, -1], [-1, 9]]
    sparse = {"data": [5, 9], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 2],
              "sparse_col_indices": [0, 1]}
    req, layout = sample_request(Fields(_asample(sparse)), 100)
    assert array(req.target_prompt_logprobs).tolist() == [[5, -1], [-1, 9]]  # unlisted cells ask for nothing
    assert layout is not None and np.frombuffer(layout.col_indices, "<i8").tolist() == [0, 1]
    bad = {"floats": ({**sparse, "dtype": "float32"}, "target_prompt_logprobs.dtype = 'float32'"),
           "crow alone": ({**sparse, "sparse_col_indices": None}, "go together"),
           "not ids": ({**sparse, "data": [5, 1.5]}, "target_prompt_logprobs.data must be a list of integers"),
           "bad layout": ({**sparse, "sparse_col_indices": [0, 2]}, "is not a valid CSR layout of shape [2, 2]"),
           "too many cells": ({**sparse, "shape": [2, 200]}, "holds 400 values once dense")}
    for body, fragment in bad.values():
        with pytest.raises(InvalidArgument, match=re.escape(fragment)):
            sample_request(Fields(_asample(body)), 100)
