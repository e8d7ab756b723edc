"""The sglang sampler engine's contract, end to end: a stack whose sampler pool runs ``--engine sglang`` against a
server that speaks SGLang's HTTP API, driven through Lathe's SDK (gRPC door) and the official ``tinker`` SDK (HTTP
door).

The server is Lathe's native engine behind SGLang's API (``python -m lathe.sampler.sglang_api``, a real process on
loopback), and, when ``LATHE_SGLANG_URL`` names one, a real SGLang server too (a GPU machine's: docs/gpu.md says how
to start it; ``LATHE_SGLANG_ADAPTER_DIR`` must be a directory that server reads). Both runs assert the same things,
with tolerances where SGLang's kernels are not Lathe's (logprobs compared to the trainer's within 0.05).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinker
from tokenizers import Tokenizer

import lathe
from lathe.errors import LatheError
from lathe.runtime.serving import READY_MARK
from lathe.stack import Stack, StackConfig

BASE = "lathe/tiny-llama"
PROMPT = [5, 17, 42, 9, 33, 120, 7]
URL_ENV, DIR_ENV = "LATHE_SGLANG_URL", "LATHE_SGLANG_ADAPTER_DIR"
ADAPTER_CAP = 2  # the pool's --adapter-cache: adapters kept loaded in the server
TOLERANCE = 0.05  # |SGLang's logprob - the trainer's| (Lathe's own engine behind the API: equal bits)
# every sample through this pool warns so (the point of one test below); the others need not repeat it
pytestmark = pytest.mark.filterwarnings("ignore:Lathe. the sampler pool.*fingerprint 'sglang':RuntimeWarning")


@dataclass(frozen=True)
class Server:
    url: str
    adapter_dir: Path
    native: bool  # Lathe's engine behind SGLang's API (it reports its adapter loads in /get_model_info)

    def model_info(self) -> dict:
        import json

        with urllib.request.urlopen(f"{self.url}/get_model_info", timeout=30) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module", params=["lathe-sglang-api", "sglang"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
           tiny_dir: Path) -> Iterator[Server]:
    adapters = tmp_path_factory.mktemp("published")
    if request.param == "sglang":
        url = os.environ.get(URL_ENV)
        if not url:
            pytest.skip(f"{URL_ENV} names no SGLang server (a GPU machine's; docs/gpu.md)")
        yield Server(url.rstrip("/"), Path(os.environ.get(DIR_ENV) or adapters), native=False)
        return
    args = ["--models", BASE, "--cache-root", str(model_cache), "--device", "cpu", "--dtype", "float32",
            "--threads", "1", "--port", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "lathe.sampler.sglang_api", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        address = None
        for line in proc.stdout:  # ends when the process does
            if READY_MARK in line:
                address = line.strip().rsplit(" ", 1)[-1]
                break
        assert address is not None, f"lathe.sampler.sglang_api exited with code {proc.wait()}"
        yield Server(f"http://{address}", adapters, native=True)
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture(scope="module")
def stack(server: Server, tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Stack]:
    cfg = StackConfig(models=BASE, store_root=tmp_path_factory.mktemp("store"), cache_root=model_cache,
                      trainer_threads=1, sampler_threads=1, metrics=True,
                      sampler_args=("--engine", "sglang", "--sglang-url", server.url, "--sglang-adapter-dir",
                                    str(server.adapter_dir), "--adapter-cache", str(ADAPTER_CAP)))
    with Stack(cfg) as s:
        yield s


@pytest.fixture
def clients(stack: Stack) -> Iterator[Callable[[str], tuple[lathe.ServiceClient, tinker.ServiceClient]]]:
    """Both SDKs' clients of the stack under an API key, closed when the test ends (an open official client
    heartbeats on into a stack that has stopped)."""
    made: list[tuple[lathe.ServiceClient, tinker.ServiceClient]] = []

    def make(key: str) -> tuple[lathe.ServiceClient, tinker.ServiceClient]:
        made.append((lathe.ServiceClient(base_url=stack.gateway, api_key=key),
                     tinker.ServiceClient(base_url=stack.http_url, api_key=key)))
        return made[-1]

    yield make
    for ours, theirs in made:
        theirs.close("success").result()
        ours.close()


def seqs(res: object) -> list[tuple[list[int], list[float], str]]:
    return [(list(s.tokens), list(s.logprobs), s.stop_reason) for s in res.sequences]


def trainer_logprobs(tc: object, tokens: list[int]) -> list[float]:
    """The trainer's forward logprob of each token of ``tokens`` after the first."""
    datum = lathe.Datum(model_input=lathe.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
    return tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


def near(got: list[float | None], want: list[float]) -> bool:
    return len(got) == len(want) and all(g is not None and abs(g - w) <= TOLERANCE
                                         for g, w in zip(got, want, strict=True))


def test_seeded_samples_repeat_and_both_sdks_see_the_same_ones(stack: Stack, clients: Callable) -> None:
    lc, tc = clients("tml-sglang-seeds")
    params = {"max_tokens": 8, "seed": 11, "stop": [], "temperature": 1.0}
    ls = lc.create_sampling_client(base_model=BASE)
    first = ls.sample(lathe.ModelInput.from_ints(PROMPT), 3, lathe.SamplingParams(**params)).result()
    again = ls.sample(lathe.ModelInput.from_ints(PROMPT), 3, lathe.SamplingParams(**params)).result()
    assert seqs(first) == seqs(again)
    assert all(len(t) == 8 and r == "length" and all(lp < 0 for lp in lps) for t, lps, r in seqs(first))
    assert len({tuple(t) for t, _, _ in seqs(first)}) > 1  # each sample draws with its own seed
    ts = tc.create_sampling_client(base_model=BASE).result()
    official = ts.sample(tinker.ModelInput.from_ints(PROMPT), 3, tinker.SamplingParams(**params)).result()
    assert seqs(official) == seqs(first)


def test_a_trained_adapter_is_published_loaded_and_sampled(stack: Stack, clients: Callable) -> None:
    lc, sc = clients("tml-sglang-adapter")
    tc = lc.create_lora_training_client(BASE, rank=8, seed=3)
    datum = lathe.Datum(model_input=lathe.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:]})
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
    policy = tc.save_weights_and_get_sampling_client()
    params = lathe.SamplingParams(max_tokens=6, seed=5, stop=[])
    out = policy.sample(lathe.ModelInput.from_ints(PROMPT), 2, params).result()
    assert seqs(out) == seqs(policy.sample(lathe.ModelInput.from_ints(PROMPT), 2, params).result())
    full = PROMPT + out.sequences[0].tokens
    scored = policy.compute_logprobs(lathe.ModelInput.from_ints(full)).result()
    assert scored[0] is None and near(scored[1:], trainer_logprobs(tc, full))
    base = lc.create_sampling_client(base_model=BASE).compute_logprobs(lathe.ModelInput.from_ints(full)).result()
    assert max(abs(a - b) for a, b in zip(scored[1:], base[1:], strict=True)) > TOLERANCE  # the adapter is applied

    # the official SDK's own training run, sampled through its own sampling client
    t = sc.create_lora_training_client(BASE, rank=8, seed=4).result()
    t.forward_backward([tinker.Datum(model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
                                     loss_fn_inputs={"target_tokens": PROMPT[1:]})], "cross_entropy").result()
    t.optim_step(tinker.AdamParams(learning_rate=0.05)).result()
    ts = t.save_weights_and_get_sampling_client().result()
    tparams = tinker.SamplingParams(max_tokens=6, seed=5, stop=[])
    res = ts.sample(tinker.ModelInput.from_ints(PROMPT), 2, tparams).result()
    assert seqs(res) == seqs(ts.sample(tinker.ModelInput.from_ints(PROMPT), 2, tparams).result())
    assert all(len(s.tokens) == 6 for s in res.sequences)


def test_stop_tokens_and_strings_end_sequences_as_the_native_rule_does(stack: Stack, tiny_dir: Path,
                                                                        clients: Callable) -> None:
    from lathe.sampler.stops import StopRule

    lc, tc = clients("tml-sglang-stops")
    ls = lc.create_sampling_client(base_model=BASE)
    greedy = {"max_tokens": 10, "temperature": 0.0}
    free = ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(**greedy, stop=[])).result()
    tokens = free.sequences[0].tokens
    stop_id = tokens[3]
    by_id = ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(**greedy, stop=[stop_id])).result()
    assert by_id.sequences[0].tokens == tokens[: tokens.index(stop_id) + 1]
    assert by_id.sequences[0].stop_reason == "stop"

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    text = tok.decode(tokens[4:6], skip_special_tokens=False)
    rule = StopRule(strings=(text,), tokenizer=tok)
    cut = next(k for k in range(1, len(tokens) + 1) if rule.hit(tokens[:k]))
    ts = tc.create_sampling_client(base_model=BASE).result()
    by_text = ts.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(**greedy, stop=[text])).result()
    assert (by_text.sequences[0].tokens, by_text.sequences[0].stop_reason) == (tokens[:cut], "stop")


def test_prompt_and_top_k_logprobs_are_the_trainers(stack: Stack, clients: Callable) -> None:
    lc, tc = clients("tml-sglang-scores")
    trainer = lc.create_lora_training_client(BASE, rank=8, seed=1)  # a fresh adapter: B = 0, the base model
    want = trainer_logprobs(trainer, PROMPT)
    ls = lc.create_sampling_client(base_model=BASE)
    res = ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(max_tokens=3, seed=2, stop=[]),
                    include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3).result()
    assert res.prompt_logprobs[0] is None and near(res.prompt_logprobs[1:], want)
    top = res.topk_prompt_logprobs
    assert top[0] is None and all(len(row) == 4 for row in top[1:])
    for row, lp, token in zip(top[1:], res.prompt_logprobs[1:], PROMPT[1:], strict=True):
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True) and values[0] >= lp - TOLERANCE
        assert all(abs(v - lp) <= TOLERANCE for t, v in row if t == token)
    seq = res.sequences[0]
    assert len(seq.topk_logprobs) == 3 and all(len(row) == 3 for row in seq.topk_logprobs)
    assert all(row[0][1] >= lp - TOLERANCE for row, lp in zip(seq.topk_logprobs, seq.logprobs, strict=True))

    last = ls.compute_logprobs(lathe.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=2).result()
    assert last[:-2] == [None] * (len(PROMPT) - 2) and near(last[-2:], want[-2:])
    official = tc.create_sampling_client(base_model=BASE).result().compute_logprobs(
        tinker.ModelInput.from_ints(PROMPT))
    assert near(official.result()[1:], want)


def test_the_exactness_verdict_and_warning_name_the_sglang_pool(stack: Stack, clients: Callable) -> None:
    lc, _ = clients("tml-sglang-exact")
    model = next(m for m in lc.get_server_capabilities().supported_models if m.model_name == BASE)
    s = model.sampler_exactness
    assert (s.checked, s.exact, s.fingerprint, model.logprobs_exact) == (True, False, "sglang", False)
    assert "sglang" in s.first_failure and "not bit-equal" in s.first_failure
    assert model.trainer_exactness.exact  # the trainer is Lathe's own: the verdict is the sampler's
    ls = lc.create_sampling_client(base_model=BASE)
    with pytest.warns(RuntimeWarning, match="sampler pool that ran 'sample' \\(fingerprint 'sglang'\\) is not exact"):
        ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(max_tokens=2, seed=1)).result()


def adapter_events(stack: Stack) -> dict[str, float]:
    with urllib.request.urlopen(stack.metrics_urls["sampler"], timeout=30) as r:
        text = r.read().decode()
    return {event: float(value) for event, value in
            re.findall(r'^lathe_sampler_engine_adapters_total\{event="(\w+)"\} (\S+)$', text, re.M)}


def test_adapters_past_the_cap_are_unloaded_from_the_server(stack: Stack, server: Server, clients: Callable) -> None:
    lc, _ = clients("tml-sglang-evict")
    before = adapter_events(stack)
    policies = [lc.create_lora_training_client(BASE, rank=4, seed=i).save_weights_and_get_sampling_client()
                for i in range(ADAPTER_CAP + 2)]
    for p in policies:
        out = p.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(max_tokens=2, seed=1)).result()
        assert len(out.sequences[0].tokens) == 2
    after = adapter_events(stack)
    loads = after.get("load", 0) - before.get("load", 0)
    unloads = after.get("unload", 0) - before.get("unload", 0)
    assert loads == ADAPTER_CAP + 2 and unloads >= 2
    assert after.get("load", 0) - after.get("unload", 0) <= ADAPTER_CAP
    published = [d for d in server.adapter_dir.iterdir() if d.is_dir()] if server.adapter_dir.exists() else []
    assert len(published) <= ADAPTER_CAP  # an unloaded adapter's directory goes too
    if server.native:  # Lathe's server also counts what it was told (SGLang's /get_model_info does not)
        info = server.model_info()
        assert len(info["loaded_lora_adapters"]) <= ADAPTER_CAP and info["lora_unloads"] >= unloads


def test_an_adapter_the_server_lost_is_loaded_again(stack: Stack, server: Server, clients: Callable) -> None:
    """A restarted SGLang container forgets its adapters while the sampler still lists them: the next request that
    needs one loads it again instead of failing for ever."""
    import json

    lc, _ = clients("tml-sglang-lost")
    policy = lc.create_lora_training_client(BASE, rank=4, seed=9).save_weights_and_get_sampling_client()
    params = lathe.SamplingParams(max_tokens=3, seed=2, stop=[])
    first = policy.sample(lathe.ModelInput.from_ints(PROMPT), 1, params).result()
    loads = adapter_events(stack).get("load", 0)
    published = [d.name for d in server.adapter_dir.iterdir() if d.is_dir()]
    for name in published:  # what a restart does to the server's list
        request = urllib.request.Request(f"{server.url}/unload_lora_adapter", json.dumps({"lora_name": name}).encode(),
                                         {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).close()
    again = policy.sample(lathe.ModelInput.from_ints(PROMPT), 1, params).result()
    assert seqs(again) == seqs(first)
    assert adapter_events(stack).get("load", 0) == loads + 1
    # the others it lost are dropped from the pool's list when their turn to be evicted comes (no unload to fail on)
    for i in range(ADAPTER_CAP + 1):
        fresh = lc.create_lora_training_client(BASE, rank=4, seed=20 + i).save_weights_and_get_sampling_client()
        fresh.sample(lathe.ModelInput.from_ints(PROMPT), 1, params).result()
    assert len([d for d in server.adapter_dir.iterdir() if d.is_dir()]) <= ADAPTER_CAP


def test_bad_requests_get_errors_that_name_the_field(stack: Stack, clients: Callable) -> None:
    lc, _ = clients("tml-sglang-errors")
    ls = lc.create_sampling_client(base_model=BASE)
    with pytest.raises(LatheError, match="vocabulary"):
        ls.sample(lathe.ModelInput.from_ints([5, 10**7]), 1, lathe.SamplingParams(max_tokens=2)).result()
    with pytest.raises(LatheError, match="prompt_alt_tokens_k = 2 is not served by this sampler pool"):
        ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(max_tokens=2),
                  prompt_alt_tokens_k=2).result()
    with pytest.raises(LatheError, match="temperature"):
        ls.sample(lathe.ModelInput.from_ints(PROMPT), 1, lathe.SamplingParams(max_tokens=2, temperature=-1.0)).result()
    assert math.isfinite(ls.sample(lathe.ModelInput.from_ints(PROMPT), 1,
                                   lathe.SamplingParams(max_tokens=1, seed=1)).result().sequences[0].logprobs[0])


# ---- without a server ----

def test_the_generate_body_carries_lathes_sampling_params_and_a_seed_per_sample() -> None:
    from lathe.sampler.sampling import sample_seed
    from lathe.sampler.sglang_wire import generate_body
    from lathe.sampler.validate import ModelLimits, check_sample
    from lathe.v1 import lathe_pb2 as pb

    params = pb.SamplingParams(temperature=0.7, top_k=0, top_p=0.9, max_tokens=5, seed=3, stop_token_ids=[9])
    plan = check_sample(pb.SampleRequest(prompt=PROMPT, num_samples=2, params=params, prompt_logprobs=True,
                                         topk_sample_logprobs=2), ModelLimits("m", 1000, 64, (2,), None), 10**6)
    body = generate_body(plan, "lathe-x")
    assert body["input_ids"] == [PROMPT, PROMPT] and body["lora_path"] == ["lathe-x", "lathe-x"]
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (True, 0, 2)
    first, second = body["sampling_params"]
    assert first == {"max_new_tokens": 5, "temperature": 0.7, "top_p": pytest.approx(0.9), "top_k": -1,
                     "sampling_seed": sample_seed(3, 0), "stop_token_ids": [2, 9], "ignore_eos": False}
    assert second["sampling_seed"] == sample_seed(3, 1) != first["sampling_seed"]
    never = check_sample(pb.SampleRequest(prompt=PROMPT, num_samples=1, params=pb.SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=5)), ModelLimits("m", 1000, 64, (2,), None), 10**6)
    assert generate_body(never, None)["sampling_params"][0]["ignore_eos"] is True  # stop=[]: not even at EOS


def test_the_sglang_engine_needs_a_server_url_and_a_shared_adapter_directory() -> None:
    from lathe.sampler.config import SamplerConfig

    with pytest.raises(ValueError, match="--sglang-url"):
        SamplerConfig(device="cpu", engine="sglang")
    with pytest.raises(ValueError, match="--sglang-adapter-dir"):
        SamplerConfig(device="cpu", engine="sglang", sglang_url="http://127.0.0.1:1")


def test_an_unreachable_server_answers_unavailable_naming_it(tmp_path: Path, model_cache: Path,
                                                             tiny_dir: Path) -> None:
    import socket

    from lathe.models.catalog import ModelCatalog
    from lathe.sampler.config import SamplerConfig
    from lathe.sampler.sglang import SGLangEngine
    from lathe.v1 import lathe_pb2 as pb

    with socket.create_server(("127.0.0.1", 0)) as s:
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends: nobody listens there
    cfg = SamplerConfig(models=BASE, cache_root=model_cache, device="cpu", engine="sglang", sglang_url=url,
                        sglang_adapter_dir=str(tmp_path))
    engine = SGLangEngine(cfg, ModelCatalog.from_spec(BASE, model_cache))
    engine.start()
    try:
        res = engine.sample(pb.SampleRequest(base_model=BASE, prompt=PROMPT, num_samples=1, params=pb.SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=2))).result()
        assert res.error.code == "Unavailable" and url in res.error.message and "/generate" in res.error.message
        assert not engine.capabilities().supported_models[0].sampler_exactness.checked  # never answered
    finally:
        engine.stop()


def test_adapters_in_use_stay_loaded_and_the_least_recently_used_idle_one_goes_first(tmp_path: Path) -> None:
    import asyncio

    from lathe.errors import FailedPrecondition
    from lathe.sampler.intake import Ask
    from lathe.sampler.sglang_adapters import ServerAdapters, lora_name

    config = b'{"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"], "base_model_name_or_path": "m"}'
    files = {"adapter_model.safetensors": b"weights", "adapter_config.json": config}

    class Store:  # an AdapterSource: every checkpoint at version 1.0
        def get(self, tenant: str, path: str) -> tuple[dict[str, bytes], float]:
            return files, 1.0

    calls: list[tuple[str, str]] = []

    async def post(route: str, body: dict) -> None:
        calls.append((route, body["lora_name"]))

    def ask(path: str, version: float = 1.0) -> Ask:
        return Ask("r", 0, "t", "m", path, version)

    async def scenario() -> None:
        adapters = ServerAdapters(Store(), tmp_path, 1, post)
        a = await adapters.acquire(ask("a"))
        b = await adapters.acquire(ask("b"))  # over capacity, but a is in use: both stay
        assert calls == [("/load_lora_adapter", a), ("/load_lora_adapter", b)] and len(adapters) == 2
        assert (tmp_path / a / "adapter_config.json").is_file() and (tmp_path / a / "lathe_export.json").is_file()
        await adapters.release(a)  # a is idle and least recently used: unloaded, its directory removed
        assert calls[-1] == ("/unload_lora_adapter", a) and not (tmp_path / a).exists()
        await adapters.release(b)
        assert len(adapters) == 1 and len(calls) == 3
        with pytest.raises(FailedPrecondition, match="overwritten"):
            await adapters.acquire(ask("c", version=0.5))
        assert len(calls) == 3 and lora_name(("t", "c", 1.0)) != lora_name(("t", "c", 0.5))

    asyncio.run(scenario())
