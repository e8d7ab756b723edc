"""The OpenAI-compatible routes through the official ``openai`` package, against the shared stack's real gateway.

A trained adapter (two SFT steps through the official tinker SDK, saved for the sampler) and the base model are
called by completions and chat completions, streaming and not; each answer's tokens and logprobs are compared with
what Tinker's ``sample`` returns for the same prompt and seed (the logprobs bit for bit), a chat's prompt with what
transformers' ``apply_chat_template`` renders, and the errors with OpenAI's schema and the field they name.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tinker
from transformers import AutoTokenizer

from lathe.stack import Stack
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
KEY = "tml-openai"
PROMPT = [5, 17, 42, 99, 7, 3]
SEED = 1234


@pytest.fixture(scope="module")
def adapter(stack: Stack) -> str:
    """A sampler checkpoint of a run trained two SFT steps (its logprobs differ from the base model's)."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key=KEY)
    t = sc.create_lora_training_client(BASE, rank=4, seed=3).result()
    data = [next_token_datum(range(i, i + 16), tinker.types) for i in (10, 40)]
    for _ in range(2):
        t.forward_backward(data, "cross_entropy").result()
        t.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
    return t.save_weights_for_sampler("openai").result().path


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)


def tinker_sample(stack: Stack, model: str, prompt: list[int], n: int = 1, **params: object) -> list:
    """Tinker's ``sample`` of ``prompt`` on ``model`` (a base model or a sampler path): its sequences."""
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key=KEY)
    sampler = (sc.create_sampling_client(model_path=model) if model.startswith("tinker://") else
               sc.create_sampling_client(base_model=model)).result()
    return sampler.sample(tinker.ModelInput.from_ints(prompt), n, tinker.SamplingParams(**params)).result().sequences


@pytest.mark.parametrize("which", ["base", "adapter"])
def test_completions_answer_the_tokens_and_logprobs_that_sample_does(stack: Stack, client: openai.OpenAI,
                                                                     tokenizer: object, adapter: str,
                                                                     which: str) -> None:
    model = BASE if which == "base" else adapter
    ref = tinker_sample(stack, model, PROMPT, 2, max_tokens=8, temperature=0.9, seed=SEED)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=SEED, n=2,
                                    logprobs=3)
    assert out.object == "text_completion" and out.model == model and len(out.choices) == 2
    for choice, seq in zip(out.choices, ref, strict=True):
        lp = choice.logprobs
        assert np.array_equal(np.asarray(lp.token_logprobs, np.float32), np.asarray(seq.logprobs, np.float32))
        assert lp.tokens == [tokenizer.decode([t]) for t in seq.tokens]
        assert choice.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if seq.stop_reason == "stop" else "length")
        assert all(len(top) <= 3 and max(top.values()) >= lp_i for top, lp_i in zip(lp.top_logprobs,
                                                                                    lp.token_logprobs, strict=True))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == len(PROMPT)  # once per prompt, whatever n is (as OpenAI counts)
    assert out.usage.completion_tokens == sum(len(s.tokens) for s in ref)


def test_the_adapter_answers_other_logprobs_than_the_base_model(client: openai.OpenAI, adapter: str) -> None:
    got = [client.completions.create(model=m, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
           .choices[0].logprobs.token_logprobs[0] for m in (BASE, adapter)]
    assert got[0] != got[1]


def test_a_text_prompt_is_encoded_by_the_models_own_tokenizer(stack: Stack, client: openai.OpenAI,
                                                              tokenizer: object) -> None:
    text = "hello world, the sum is"
    ids = tokenizer(text)["input_ids"]
    ref = tinker_sample(stack, BASE, ids, max_tokens=6, temperature=0.7, seed=SEED)[0]
    out = client.completions.create(model=BASE, prompt=text, max_tokens=6, temperature=0.7, seed=SEED, logprobs=0)
    assert out.usage.prompt_tokens == len(ids)
    assert np.array_equal(np.asarray(out.choices[0].logprobs.token_logprobs, np.float32),
                          np.asarray(ref.logprobs, np.float32))


@pytest.mark.parametrize("which", ["base", "adapter"])
def test_chat_completions_render_the_chat_template_and_answer_samples_logprobs(
        stack: Stack, client: openai.OpenAI, tokenizer: object, adapter: str, which: str) -> None:
    model = BASE if which == "base" else adapter
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    ref = tinker_sample(stack, model, prompt, max_tokens=10, temperature=1.0, seed=SEED)[0]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=10, seed=SEED, logprobs=True,
                                         top_logprobs=2)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.usage.prompt_tokens == len(prompt)
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(ref.tokens, skip_special_tokens=True)
    content = choice.logprobs.content
    assert np.array_equal(np.asarray([c.logprob for c in content], np.float32), np.asarray(ref.logprobs, np.float32))
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref.tokens]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_streams_carry_the_same_text_and_logprobs_as_the_whole_answer(client: openai.OpenAI, adapter: str) -> None:
    whole = client.completions.create(model=adapter, prompt=PROMPT, max_tokens=8, seed=SEED, logprobs=1)
    chunks = list(client.completions.create(model=adapter, prompt=PROMPT, max_tokens=8, seed=SEED, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs] == \
        whole.choices[0].logprobs.token_logprobs
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model=adapter, messages=messages, max_tokens=8, seed=SEED, logprobs=True)
    stream = list(client.chat.completions.create(model=adapter, messages=messages, max_tokens=8, seed=SEED,
                                                 logprobs=True, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert [lp.logprob for c in stream if c.choices[0].logprobs for lp in c.choices[0].logprobs.content] == \
        [lp.logprob for lp in chat.choices[0].logprobs.content]


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, seed=SEED).choices[0].text
    stop = next(ch for ch in free[2:] if not ch.isspace())
    cut = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, seed=SEED, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]


def test_models_lists_the_base_models_and_only_the_callers_checkpoints(stack: Stack, client: openai.OpenAI,
                                                                       adapter: str) -> None:
    ids = [m.id for m in client.models.list()]
    assert BASE in ids and adapter in ids
    other = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="tml-openai-other", max_retries=0)
    assert adapter not in [m.id for m in other.models.list()]
    with pytest.raises(openai.APIStatusError) as e:
        other.completions.create(model=adapter, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code in (403, 404)


def test_bad_requests_answer_openais_error_schema_naming_the_field(stack: Stack, client: openai.OpenAI) -> None:
    cases = [
        (dict(temperature=3.0), "temperature = 3.0"),
        (dict(echo=True), "echo"),
        (dict(logprobs=21), "logprobs = 21"),
        (dict(prompt=[]), "prompt"),
        (dict(model="no/such-model"), "no/such-model"),
        (dict(stop=[""]), "stop"),
        (dict(max_tokens=0), "max_tokens = 0"),
        (dict(frequency_penalty=0.5), "frequency_penalty"),
    ]
    for change, named in cases:
        kwargs = {"model": BASE, "prompt": PROMPT, "max_tokens": 2, **change}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kwargs)
        assert named in e.value.message and e.value.type == "invalid_request_error", (change, e.value.message)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role is required"):
        client.chat.completions.create(model=BASE, messages=[{"content": "hi"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.http_url + "/v1", api_key="not-a-tinker-key", max_retries=0).models.list()
    raw = httpx.post(stack.http_url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                     content=b"[1, 2]")
    assert raw.status_code == 400 and raw.json()["error"]["message"] == \
        "the request body must be a JSON object, got list"


def test_several_prompts_answer_their_choices_prompt_by_prompt(stack: Stack, client: openai.OpenAI) -> None:
    prompts = [PROMPT, [9, 8, 7, 6]]
    out = client.completions.create(model=BASE, prompt=prompts, max_tokens=4, seed=SEED, n=2, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        ref = tinker_sample(stack, BASE, prompt, 2, max_tokens=4, seed=SEED)
        for choice, seq in zip(out.choices[2 * i:2 * i + 2], ref, strict=True):
            assert choice.logprobs.token_logprobs == [float(np.float32(x)) for x in seq.logprobs]
    assert out.usage.prompt_tokens == len(PROMPT) + 4
