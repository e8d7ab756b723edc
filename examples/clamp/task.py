"""Prompts, chat rendering and reference completions for the clamp task.

In: nothing but a prompt index or a seed. Out: ChatML text for SmolLM2-135M-Instruct and
(prompt, completion) pairs for supervised training. The assistant turn is prefilled with a python
fence and the function header ending at ``):`` (CLAMP.md: a prefill that ends with a newline made the
model close the block at once), so a completion starts with the newline before the body.
"""

from __future__ import annotations

import random

# (x, lo, hi, expected): below, inside, above the range, a zero-width range, negative bounds.
FIXTURES: tuple[tuple[int, int, int, int], ...] = (
    (-1, 0, 2, 0), (1, 0, 2, 1), (3, 0, 2, 2), (3, 2, 2, 2), (-4, -3, -1, -3),
)

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
END_OF_TURN = "<|im_end|>"
PREFILL = "```python\ndef clamp(x, lo, hi):"
MINMAX_HINT = "Use the built-in min and max functions."

_REQUESTS = (
    "Write a Python function clamp(x, lo, hi) that returns x limited to the range from lo to hi.",
    "Write clamp(x, lo, hi) in Python: return lo if x is below lo, hi if x is above hi, "
    "and x otherwise.",
    "Write a Python function clamp(x, lo, hi) that restricts the number x to the closed "
    "interval [lo, hi].",
    "Please write clamp(x, lo, hi), a Python function whose result is never below lo and "
    "never above hi.",
)
# Every request plain, then every request with the min/max hint CLAMP.md found helpful.
PROMPTS: tuple[str, ...] = _REQUESTS + tuple(f"{r} {MINMAX_HINT}" for r in _REQUESTS)

# Correct bodies as the model would write them after PREFILL, closing the fence.
MINMAX_COMPLETIONS: tuple[str, ...] = (
    "\n    return min(max(x, lo), hi)\n```",
    "\n    return max(lo, min(x, hi))\n```",
    "\n    return min(hi, max(lo, x))\n```",
)
BRANCH_COMPLETIONS: tuple[str, ...] = (
    "\n    if x < lo:\n        return lo\n    elif x > hi:\n        return hi\n    else:\n        return x\n```",
    "\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n```",
    "\n    return lo if x < lo else hi if x > hi else x\n```",
)


def chat_messages(prompt: str) -> list[dict[str, str]]:
    """The conversation for one request: SmolLM2's default system prompt, then the user turn."""
    return [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": prompt}]


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render messages exactly as SmolLM2-Instruct's chat template does.

    A conversation that does not open with a system message gets the default system prompt; every
    message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt opens an
    assistant turn.
    """
    parts = []
    if not messages or messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{DEFAULT_SYSTEM}{END_OF_TURN}\n")
    parts += [f"<|im_start|>{m['role']}\n{m['content']}{END_OF_TURN}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_prompt(prompt: str) -> str:
    """The full text the model continues from: the rendered chat plus the assistant prefill."""
    return render_chatml(chat_messages(prompt)) + PREFILL


def reference_solution() -> str:
    """A correct completion, as the model would write it after ``PREFILL``."""
    return MINMAX_COMPLETIONS[0]


def sft_examples(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (rendered prompt with prefill, completion) pairs, deterministic in ``seed``.

    Prompts that ask for min and max get a min/max body; the others get any correct style. Each
    completion ends with the end-of-turn token so the model also learns to stop after the fence.
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        prompt = rng.choice(PROMPTS)
        styles = MINMAX_COMPLETIONS if MINMAX_HINT in prompt else MINMAX_COMPLETIONS + BRANCH_COMPLETIONS
        examples.append((render_prompt(prompt), rng.choice(styles) + END_OF_TURN))
    return examples
