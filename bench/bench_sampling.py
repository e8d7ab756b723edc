"""Sampling speed: Lathe's native sampler vs. transformers ``generate`` with peft adapters.

Same base model, same four random LoRA adapters (rank 32 on all seven targets and the LM head,
random non-zero B), same fixed prompts, greedy decoding with EOS off so every sequence makes exactly
``--new-tokens`` tokens. Cases:
  batch      ``--sequences`` concurrent sequences spread over the adapters: Lathe's engine (requests
             submitted at once, continuous batching) vs. one ``generate`` call over the whole batch
             with peft's mixed-adapter batch (``adapter_names=``); tokens/s of new tokens
  single     one sequence on one adapter: decode latency per token, (T(1 + N) - T(1)) / N, so the
             prefill is not counted, for both
  invariance one decode step of the batch in Lathe with batch-invariant ops on vs. off:
             (T(N) - T(1)) / (N - 1) for the whole batch
Each figure is the median of ``--repeats`` timed runs after one warm-up run. Also printed: how many
greedy tokens Lathe and transformers agree on (a check that both run the same model and adapters).

Run it alone (other processes on the same cores distort CPU timings badly):
  python bench/bench_sampling.py                 SmolLM2-135M-Instruct (imported once into --cache-root)
  python bench/bench_sampling.py --model tiny    the tiny test model (a smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lathe.models.config import ModelConfig
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.pool import DTYPES, on_passing_thread
from lathe.sampler.config import SamplerConfig
from lathe.sampler.engine import SamplerEngine
from lathe.trainer.bank import Adapter
from lathe.trainer.optimizer import AdamState
from lathe.v1 import lathe_pb2 as pb

BASE = "bench-base"
TENANT = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--cache-root", type=Path, default=Path(".cache/lathe"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (median reported)")
    args = p.parse_args(argv)
    for name in ("threads", "sequences", "adapters", "rank", "prompt_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    return args


def model_dir(args: argparse.Namespace) -> Path:
    if args.model == "tiny":
        from lathe.models.tiny import ensure_tiny_model

        return ensure_tiny_model(args.cache_root, "llama")
    from lathe.models.smollm2 import import_smollm2

    return import_smollm2(args.cache_root)


# ---------------------------------------------------------------- shared inputs


def random_adapter(cfg: ModelConfig, rank: int, seed: int) -> LoraWeights:
    w = LoraWeights.init(cfg, LoraSpec(rank=rank), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in w.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    return w


def sampler_files(weights: LoraWeights) -> dict[str, bytes]:
    """The bytes the trainer saves for ``save_weights_for_sampler``."""
    return Adapter("bench", TENANT, BASE, weights, AdamState.zeros(weights.named_parameters())).sampler_files()


def median_time(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------- Lathe


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    path: Path
    max_context_length: int


class _OneModel:
    """A catalog serving one directory as ``BASE``."""

    def __init__(self, path: Path, context: int) -> None:
        self.entry = _Entry(BASE, path, context)

    def resolve(self, name: str) -> _Entry:
        if name != BASE:
            raise KeyError(name)
        return self.entry

    def entries(self) -> list[_Entry]:
        return [self.entry]


class _Files:
    """An ``AdapterSource`` over in-memory checkpoints."""

    def __init__(self, files: dict[str, dict[str, bytes]]) -> None:
        self.files = files

    def get(self, tenant: str, path: str) -> tuple[dict[str, bytes], float]:
        return self.files[path], 1.0


def lathe_engine(path: Path, cfg: ModelConfig, dtype: str, invariant: bool, files: dict[str, dict[str, bytes]],
                 sequences: int) -> SamplerEngine:
    engine = SamplerEngine(SamplerConfig(dtype=dtype, invariant=invariant, max_running=sequences,
                                         adapter_cache=len(files)),
                           _OneModel(path, cfg.max_position_embeddings), _Files(files))
    engine.start()
    return engine


def lathe_generate(engine: SamplerEngine, prompts: list[list[int]], paths: list[str], new_tokens: int
                   ) -> list[list[int]]:
    """Greedy, EOS off: submit every prompt at once and wait for all; the generated tokens."""
    futures = [engine.sample(pb.SampleRequest(
        prompt=p, num_samples=1, tenant=TENANT, base_model=BASE, model_path=path, model_version=1.0 if path else 0.0,
        params=pb.SamplingParams(max_tokens=new_tokens, temperature=0.0, top_p=1.0, use_eos=False),
    )) for p, path in zip(prompts, paths, strict=True)]
    results = [f.result() for f in futures]
    for r in results:
        if r.WhichOneof("result") != "sample":
            raise RuntimeError(f"sampling failed: {r.error}")
    return [list(r.sample.sequences[0].tokens) for r in results]


# ---------------------------------------------------------------- transformers + peft


def hf_model(path: Path, dtype: torch.dtype, files: dict[str, dict[str, bytes]], workdir: Path
             ) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    base.generation_config.eos_token_id = None  # EOS off, as in Lathe's use_eos=False
    model = None
    for i, content in enumerate(files.values()):
        d = workdir / f"adapter{i}"
        d.mkdir()
        for name, data in content.items():
            (d / name).write_bytes(data)
        if model is None:
            model = PeftModel.from_pretrained(base, d, adapter_name=f"a{i}")
        else:
            model.load_adapter(d, adapter_name=f"a{i}")
    return model.eval()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], names: list[str], new_tokens: int
                ) -> list[list[int]]:
    """Greedy, EOS off, one ``generate`` over all prompts (equal lengths, no padding)."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


# ---------------------------------------------------------------- the cases


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model_dir(args)
    cfg = ModelConfig.from_dir(path)
    # made on a passing thread, so that the main thread keeps no OpenMP team beside the engines' (lathe.models.pool)
    files = on_passing_thread(lambda: {f"tinker://bench-{i}/sampler_weights/s":
                                       sampler_files(random_adapter(cfg, args.rank, 100 + i))
                                       for i in range(args.adapters)})
    paths = [list(files)[i % args.adapters] for i in range(args.sequences)]
    names = [f"a{i % args.adapters}" for i in range(args.sequences)]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(cfg.vocab_size, (args.sequences, args.prompt_tokens), generator=gen).tolist()
    n, r = args.new_tokens, args.repeats
    rows: list[tuple[str, str, float, str]] = []

    # One engine alive at a time, as in a sampler process: two scheduler threads would each keep an OpenMP team,
    # and with more OpenMP workers than cores libgomp stops spinning and every small op pays a wake-up.
    t_batch, t_one, step = {}, {}, {}
    for inv in (True, False):
        eng = lathe_engine(path, cfg, args.dtype, inv, files, args.sequences)
        try:
            if inv:
                lathe_tokens = lathe_generate(eng, prompts, paths, n)
            t_batch[inv] = median_time(lambda eng=eng: lathe_generate(eng, prompts, paths, n), r)
            t_one |= {(inv, k): median_time(lambda k=k, eng=eng: lathe_generate(eng, prompts[:1], paths[:1], k), r)
                      for k in (1, 1 + n)}
            t = {k: median_time(lambda k=k, eng=eng: lathe_generate(eng, prompts, paths, k), r) for k in (1, n)}
            step[inv] = (t[n] - t[1]) / (n - 1)
        finally:
            eng.stop()

    with tempfile.TemporaryDirectory() as tmp:
        model = hf_model(path, DTYPES[args.dtype], files, Path(tmp))
        hf_tokens = hf_generate(model, prompts, names, n)
        h_batch = median_time(lambda: hf_generate(model, prompts, names, n), r)
        h_one = {k: median_time(lambda k=k: hf_generate(model, prompts[:1], names[:1], k), r) for k in (1, 1 + n)}

    total = args.sequences * n
    lathe_tps, hf_tps = total / t_batch[True], total / h_batch
    lathe_lat, hf_lat = (t_one[True, 1 + n] - t_one[True, 1]) / n, (h_one[1 + n] - h_one[1]) / n
    plain_lat = (t_one[False, 1 + n] - t_one[False, 1]) / n
    rows += [
        ("batch throughput", "lathe", lathe_tps, "tokens/s"),
        ("batch throughput", "lathe plain ops", total / t_batch[False], "tokens/s"),
        ("batch throughput", "transformers+peft", hf_tps, "tokens/s"),
        ("single-sequence decode", "lathe", lathe_lat * 1e3, "ms/token"),
        ("single-sequence decode", "lathe plain ops", plain_lat * 1e3, "ms/token"),
        ("single-sequence decode", "transformers+peft", hf_lat * 1e3, "ms/token"),
        ("decode step, batch", "lathe invariant", step[True] * 1e3, "ms/step"),
        ("decode step, batch", "lathe plain ops", step[False] * 1e3, "ms/step"),
    ]
    agree = sum(a == b for x, y in zip(lathe_tokens, hf_tokens, strict=True) for a, b in zip(x, y, strict=True))

    print(f"model {args.model} ({path}), dtype {args.dtype}, {args.threads} threads; {args.sequences} sequences "
          f"over {args.adapters} adapters (rank {args.rank}), prompts {args.prompt_tokens} tokens, {n} new tokens; "
          f"median of {r}")
    print(f"{'case':<24} {'engine':<20} {'value':>10}  unit")
    for case, engine, value, unit in rows:
        print(f"{case:<24} {engine:<20} {value:>10.2f}  {unit}")
    print(f"throughput lathe / transformers:          x{lathe_tps / hf_tps:.2f}")
    print(f"decode latency transformers / lathe:      x{hf_lat / lathe_lat:.2f}")
    print(f"decode latency transformers / lathe plain: x{hf_lat / plain_lat:.2f}")
    print(f"decode step invariant / plain:            x{step[True] / step[False]:.2f}")
    print(f"greedy tokens equal to transformers':     {agree}/{total}")


if __name__ == "__main__":
    main()
