"""Text in and out of a base model, for the door that takes text (the OpenAI-compatible routes).

``TextCodec`` owns one base model's tokenizer (its ``tokenizer.json``, read by the ``tokenizers`` library, as the
sampler reads it for stop strings) and its chat template (``tokenizer_config.json``'s ``chat_template``, rendered by
a sandboxed jinja2 environment set up as ``transformers.apply_chat_template`` sets up its own). ``TextCodecs`` makes
one per base model on first use, from the files a sampler of that model's pool hands over (``Sampler.Tokenizer``),
and keeps it: a pool serves a model's files unchanged for its life.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from lathe.errors import FailedPrecondition, InvalidArgument
from lathe.v1 import lathe_pb2 as pb

Message = dict[str, Any]


def _special(config: dict[str, Any], name: str) -> str:
    """A special token of tokenizer_config.json, which names it as a string or as ``{"content": ...}``."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@dataclass(frozen=True)
class TextCodec:
    """One base model's tokenizer and chat template."""

    name: str
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str
    eos_token: str

    @classmethod
    def from_files(cls, name: str, files: pb.TokenizerFiles) -> TextCodec:
        config = json.loads(files.tokenizer_config_json or "{}")
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(name, Tokenizer.from_str(files.tokenizer_json), template if isinstance(template, str) else None,
                   _special(config, "bos_token"), _special(config, "eos_token"))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """``text``'s token ids; ``special``: with the tokenizer's own additions (a BOS, say), as a completion prompt
        is encoded; a rendered chat carries its special tokens as text and is encoded without them."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out (an end-of-sequence token has no text)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token's share of ``decode(ids)``: token i's piece is what decoding ``ids[:i + 1]`` adds to decoding
        ``ids[:i]`` (empty for a special token, or for the first bytes of a character that ends in a later one), so
        the pieces join to the whole text."""
        out, before = [], ""
        for i in range(len(ids)):
            text = self.decode(ids[:i + 1])
            out.append(text[len(before):] if text.startswith(before) else text)
            before = text
        return out

    def token_text(self, token_id: int) -> str:
        """One token on its own as text (special tokens included), as a logprobs entry names it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[Message]) -> str:
        """``messages`` through the model's chat template, ending with the prompt for the assistant's turn."""
        if self.chat_template is None:
            raise FailedPrecondition(f"model {self.name!r} has no chat template (tokenizer_config.json's "
                                     "chat_template): use /v1/completions with a prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token,
                tools=None)
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"messages: the chat template of {self.name!r} refused them: {e}") from None


class TextCodecs:
    """A ``TextCodec`` per base model, made once from the files ``fetch(base_model)`` returns."""

    def __init__(self, fetch: Callable[[str], Awaitable[pb.TokenizerFiles]]) -> None:
        self._fetch = fetch
        self._codecs: dict[str, TextCodec] = {}
        self._lock = asyncio.Lock()

    async def of(self, base_model: str) -> TextCodec:
        codec = self._codecs.get(base_model)
        if codec is None:
            async with self._lock:
                codec = self._codecs.get(base_model)
                if codec is None:
                    files = await self._fetch(base_model)
                    codec = await asyncio.to_thread(TextCodec.from_files, base_model, files)
                    self._codecs[base_model] = codec
        return codec
