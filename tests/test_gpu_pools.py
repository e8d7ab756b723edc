"""The trainer and sampler pools on a device: the same tests on the CPU (CI) and, marked ``gpu``, on CUDA.

Protects: ``device`` in the pool configs and the ``--device`` flag (checked, defaulting to cuda only when
present); every tensor a pool owns lands on its device with fp32 LoRA weights, gradients and AdamW
moments under a bf16 base; loading a decoder through ``from_weights`` on an explicit CPU device gives
the bits of ``from_dir``; the trainer on CUDA agrees with the CPU fp32 trainer (logprobs and LoRA
gradients) within rounding; the sampler's logprobs equal the trainer's forward on the same device bit
for bit, per-segment LoRA or SGMV; the SGMV path agrees with the per-segment path within rounding.
The CUDA cases skip, with their reason, where torch sees no GPU (``bench/gpu_check.py`` runs them on one).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lathe.kernels.sgmv_triton import triton_available
from lathe.models.catalog import ModelCatalog
from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.pool import DTYPES, default_device, resolve_dtype
from lathe.runtime.options import add_options
from lathe.sampler.adapters import adapter_dtype, load_adapter
from lathe.sampler.blocks import blocks_for
from lathe.sampler.kv import KVPool
from lathe.sampler.sampling import Rule, choose, generator
from lathe.sampler.step import Item, run_step
from lathe.trainer.bank import Adapter
from lathe.trainer.ops import Example
from lathe.trainer.optimizer import AdamState
from lathe.trainer.step import Job, JobResult, run_jobs

BASE = "lathe/tiny-llama"
CUDA = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch sees none here")]
SGMV = [*CUDA, pytest.mark.skipif(not triton_available(), reason="needs Triton with a GPU driver")]
ON_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative error against CPU fp32, by the pool dtype


# ---------------------------------------------------------------- helpers


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm().clamp_min(1e-30))


def adapter(cfg: ModelConfig, rank: int, seed: int, device: str, **targets: bool) -> LoraWeights:
    """A trainer adapter with random non-zero B (so it changes the logprobs), the same bits on every device."""
    w = LoraWeights.init(cfg, LoraSpec(rank=rank, **targets), seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in w.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return w


def adapters(cfg: ModelConfig, device: str) -> list[LoraWeights]:
    """Three adapters of different ranks and target sets."""
    return [adapter(cfg, 2, 11, device), adapter(cfg, 4, 12, device, train_mlp=False),
            adapter(cfg, 8, 13, device, train_attn=False, train_unembed=False)]


def example(tokens: list[int]) -> Example:
    return Example(tokens[:-1], torch.tensor(tokens[1:]), {"weights": torch.ones(len(tokens) - 1)})


def sequences(vocab: int, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (int(length),), generator=gen).tolist()
            for length in torch.randint(3, 70, (n,), generator=gen)]


def train(model: Decoder, weights: list[LoraWeights], seqs: list[list[int]], *, backward: bool) -> list[JobResult]:
    """One packed trainer pass: sequence i on adapter i % len(weights)."""
    jobs = [Job(weights[i % len(weights)], [example(s)], "cross_entropy", {}, backward) for i, s in enumerate(seqs)]
    return run_jobs(model, jobs)


def sample(model: Decoder, prompts: list[list[int]], weights: list[LoraWeights], new_tokens: int
           ) -> list[tuple[list[int], list[float]]]:
    """The sampler's steps, staggered: sequence i is prefilled at step i while earlier ones decode, so
    every step mixes prefill and decode rows of several adapters. Seeded draws; (tokens, logprobs) each."""
    pool = KVPool.for_model(model, len(prompts) * blocks_for(max(map(len, prompts)) + new_tokens) + 1)
    caches = [pool.sequence(b"") for _ in prompts]
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
    step = 0
    while any(len(toks) < new_tokens for toks, _ in out):
        live = [i for i in range(min(step + 1, len(prompts))) if len(out[i][0]) < new_tokens]
        items = [Item(out[i][0][-1:] or list(prompts[i]), caches[i], weights[i % len(weights)]) for i in live]
        for i, res in zip(live, run_step(model, items), strict=True):
            token = choose(res.logits, Rule(), generator(7, i * 1000 + len(out[i][0])))
            out[i][0].append(token)
            out[i][1].append(float(res.logprobs[token]))
        step += 1
    return out


# ---------------------------------------------------------------- configuration


def test_pool_configs_and_flag_take_a_device() -> None:
    from lathe.sampler.config import SamplerConfig
    from lathe.trainer.engine import TrainerConfig

    for config in (SamplerConfig, TrainerConfig):
        assert config().device == default_device()
        assert config(device="cpu").device == "cpu"
        with pytest.raises(ValueError, match="'tpu' is not one of"):
            config(device="tpu")
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="torch sees no CUDA device"):
                config(device="cuda")
    for config in (SamplerConfig, TrainerConfig):
        ap = argparse.ArgumentParser()
        add_options(ap, config)
        assert ap.parse_args([]).device == default_device()
        assert ap.parse_args(["--device", "cpu"]).device == "cpu"
        with pytest.raises(SystemExit):
            ap.parse_args(["--device", "tpu"])


def test_auto_dtype_is_bf16_only_where_the_device_multiplies_it_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dtype auto`` (the flag's default) resolves in the pool's config: bf16 on a CPU with avx512_bf16 or AMX,
    fp32 on one without (bf16 is emulated there); an explicit dtype stays, a wrong one is refused naming it."""
    from lathe.sampler.config import SamplerConfig
    from lathe.trainer.engine import TrainerConfig

    for bf16, amx, want in ((True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert resolve_dtype("auto", "cpu") == want
        for config in (SamplerConfig, TrainerConfig):
            assert config(dtype="auto", device="cpu").dtype == want
            assert config(dtype="float32", device="cpu").dtype == "float32"
            assert config(dtype="bfloat16", device="cpu").dtype == "bfloat16"
            with pytest.raises(ValueError, match="dtype 'float16' is not one of"):
                config(dtype="float16", device="cpu")
    for config in (SamplerConfig, TrainerConfig):
        ap = argparse.ArgumentParser()
        add_options(ap, config)
        assert ap.parse_args([]).dtype == "auto"


def test_from_weights_on_explicit_cpu_equals_from_dir(tiny_dir: Path) -> None:
    """bf16 base + fp32 LoRA: an explicit CPU device and the weights-dict constructor change no bit."""
    cfg = ModelConfig.from_dir(tiny_dir)
    raw = load_file(tiny_dir / "model.safetensors")
    seqs = sequences(cfg.vocab_size, 4, seed=1)
    results = []
    for model in (Decoder.from_dir(tiny_dir, dtype=torch.bfloat16),
                  Decoder.from_weights(cfg, raw, dtype=torch.bfloat16, device="cpu")):
        weights = adapters(cfg, "cpu")
        results.append((train(model, weights, seqs, backward=True), weights))
    (a, wa), (b, wb) = results
    for ra, rb in zip(a, b, strict=True):
        assert torch.equal(ra.logprobs[0], rb.logprobs[0])
    for x, y in zip(wa, wb, strict=True):
        for p, q in zip(x.parameters(), y.parameters(), strict=True):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            assert torch.equal(p.grad, q.grad)


# ---------------------------------------------------------------- on each device


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_on_device_matches_cpu_fp32(tiny_dir: Path, device: str, dtype: str) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    seqs = sequences(cfg.vocab_size, 6, seed=2)
    ref_w = adapters(cfg, "cpu")
    ref = train(Decoder.from_dir(tiny_dir), ref_w, seqs, backward=True)
    model = Decoder.from_dir(tiny_dir, dtype=DTYPES[dtype], device=device)
    assert model.w["model.norm.weight"].device.type == device and model.cos.device.type == device
    got_w = adapters(cfg, device)
    got = train(model, got_w, seqs, backward=True)
    tol = TOLERANCE[dtype]
    for r, g in zip(ref, got, strict=True):
        assert g.error is None and g.logprobs[0].device.type == "cpu"
        assert rel_err(g.logprobs[0], r.logprobs[0]) < tol
    for rw, gw in zip(ref_w, got_w, strict=True):
        for p, q in zip(rw.parameters(), gw.parameters(), strict=True):
            assert q.device.type == device and q.dtype == torch.float32 and q.grad.dtype == torch.float32
            assert rel_err(q.grad, p.grad) < 3 * tol


@pytest.mark.parametrize(("device", "sgmv"), [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cuda", False, id="cuda", marks=CUDA),
    pytest.param("cuda", True, id="cuda-sgmv", marks=SGMV),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_logprobs_equal_trainer_forward_on_device(tiny_dir: Path, device: str, sgmv: bool, dtype: str) -> None:
    model = Decoder.from_dir(tiny_dir, dtype=DTYPES[dtype], device=device)
    model.sgmv = sgmv
    cfg = model.cfg
    trainer_w = adapters(cfg, device)
    sampler_w = [load_adapter(Adapter("m", "t", BASE, w, AdamState.zeros(w.named_parameters())).sampler_files(),
                              cfg, adapter_dtype(model.dtype, sgmv), BASE, device) for w in trainer_w]
    assert all(t.device.type == device and t.dtype == adapter_dtype(model.dtype, sgmv)
               for w in sampler_w for t in w.a.values())
    prompts = sequences(cfg.vocab_size, 6, seed=3)
    sampled = sample(model, prompts, sampler_w, new_tokens=12)
    full = [p + toks for p, (toks, _) in zip(prompts, sampled, strict=True)]
    ref = train(model, trainer_w, full, backward=False)
    bad = total = 0
    for p, (_, lps), r in zip(prompts, sampled, ref, strict=True):
        want = r.logprobs[0][len(p) - 1:]
        bad += int((torch.tensor(lps) != want).sum())
        total += len(lps)
    assert bad == 0, f"{bad}/{total} sampled logprobs differ from the trainer's forward on {device}"


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=SGMV), pytest.param("bfloat16", marks=SGMV)])
def test_sgmv_path_matches_per_segment_path_on_cuda(tiny_dir: Path, dtype: str) -> None:
    model = Decoder.from_dir(tiny_dir, dtype=DTYPES[dtype], device="cuda")
    seqs = sequences(model.cfg.vocab_size, 6, seed=4)
    runs = []
    for sgmv in (False, True):
        model.sgmv = sgmv
        weights = adapters(model.cfg, "cuda")
        runs.append((train(model, weights, seqs, backward=True), weights))
    (ref, ref_w), (got, got_w) = runs
    tol = TOLERANCE[dtype]
    for r, g in zip(ref, got, strict=True):
        assert rel_err(g.logprobs[0], r.logprobs[0]) < tol
    for rw, gw in zip(ref_w, got_w, strict=True):
        for p, q in zip(rw.parameters(), gw.parameters(), strict=True):
            assert rel_err(q.grad, p.grad) < 3 * tol


@pytest.mark.parametrize("device", ON_DEVICES)
def test_engines_keep_their_state_on_the_pool_device(model_cache: Path, tiny_dir: Path, tmp_path: Path,
                                                     device: str) -> None:
    """Through the engines (these need the generated protobuf code): a bf16 trainer pool's adapter, its
    gradients, moments and paged copies stay fp32 on the device; a sampler pool on the device samples."""
    pb = _protos()
    from lathe.sampler.config import SamplerConfig
    from lathe.sampler.engine import SamplerEngine
    from lathe.trainer import intake
    from lathe.trainer.engine import TrainerConfig, TrainerEngine

    catalog = ModelCatalog.from_spec(BASE, model_cache)
    eng = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache, dtype="bfloat16", device=device,
                                      max_resident_adapters=1, page_store=str(tmp_path)),
                        catalog)
    lora = pb.LoraConfig(rank=4, seed=5, train_attn=True, train_mlp=True, train_unembed=True)
    adam = pb.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12)
    for run in ("a", "b"):
        eng.create_adapter(pb.CreateAdapterRequest(model_id=run, tenant="t", base_model=BASE, lora_config=lora))
    data = [pb.Datum(model_input=pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=list(range(3, 20)))]),
                     loss_fn_inputs={"target_tokens": pb.Tensor(data=torch.arange(4, 21).numpy().tobytes(),
                                                                dtype="int64", shape=[17])})]
    ops = [pb.TrainerOp(model_id="a", seq_id=1, tenant="t", request_id="r1",
                        forward_backward=pb.ForwardBackwardRequest(model_id="a", seq_id=1, data=data,
                                                                   loss_fn="cross_entropy")),
           pb.TrainerOp(model_id="a", seq_id=2, tenant="t", request_id="r2",
                        optim_step=pb.OptimStepRequest(model_id="a", seq_id=2, adam_params=adam))]
    futures = [intake.submit(eng, op) for op in ops]
    while not all(f.done() for f in futures):
        eng.run_cycle()
    assert [intake.result_to_proto(f.result()).WhichOneof("result") for f in futures] == [
        "forward_backward", "optim_step"]
    before = {n: t.detach().cpu().clone() for n, t in eng.bank.get("a").weights.named_parameters().items()}
    eng.bank.get("b")
    eng.bank.evict({"b"})  # pages "a" out
    assert eng.bank.paged == 1
    a = eng.bank.get("a")  # and back in
    for n, t in a.weights.named_parameters().items():
        assert t.device.type == device and t.dtype == torch.float32 and torch.equal(t.detach().cpu(), before[n])
        assert a.opt.exp_avg[n].device.type == device and a.opt.exp_avg[n].dtype == torch.float32

    sampler = SamplerEngine(SamplerConfig(models=BASE, cache_root=model_cache, dtype="bfloat16", device=device),
                            catalog)
    sampler.base(BASE)  # loaded and self-checked here: a step loop spinning beside the loader starves it
    params = pb.SamplingParams(max_tokens=5, seed=1, temperature=1.0, top_p=1.0)
    fut = sampler.sample(pb.SampleRequest(prompt=list(range(3, 12)), num_samples=2, tenant="t", base_model=BASE,
                                          request_id="s", params=params))
    while not fut.done():
        if sampler.step() == 0:
            time.sleep(0.001)  # the request is still being prepared on the loader thread
    sampler.stop()
    out = fut.result()
    assert out.WhichOneof("result") == "sample", out.error
    assert [len(s.tokens) for s in out.sample.sequences] == [5, 5]


def _protos():  # noqa: ANN202 - the generated module
    """The generated protobuf module, or a skip naming why it cannot be imported here (bench/gpu_check.py
    stands in a stub that raises ImportError on use where the generated code does not import)."""
    try:
        from lathe.v1 import lathe_pb2 as pb

        pb.TrainerOp  # noqa: B018 - touching it is the check
    except ImportError as e:
        pytest.skip(f"generated protobuf code (lathe.v1) is not importable here: {e}")
    return pb
