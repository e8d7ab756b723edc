"""The clamp task and its sandboxed grader: rewards, failure verdicts, side effects, extraction.

Every sandbox test runs a real child process; candidates that misbehave are otherwise correct, so a
missing block would show up as reward 1 or as a file that exists.
"""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import pytest

from examples.clamp import grader, task

CORRECT = "def clamp(x, lo, hi):\n    return min(max(x, lo), hi)\n"
# Rebinds every global of the sandbox script and the builtins its hook could look up.
REBIND_EVERYTHING = (
    "import __main__, builtins\n"
    "for name in [n for n in vars(__main__) if not n.startswith('__')]:\n"
    "    setattr(__main__, name, None)\n"
    "for name in ('isinstance', 'any', 'type', 'len', 'getattr', 'callable'):\n"
    "    setattr(builtins, name, lambda *args: False)\n"
)


def test_seed_candidates_rewards_and_centering() -> None:
    sources = [
        "def clamp(x, lo, hi):\n    return min(max(x, lo), hi)\n",
        "def clamp(x, lo, hi):\n    return max(min(x, lo), hi)\n",
        "clamp = lambda x, lo, hi: min(max(x, lo), hi)\n",
        "def clamp(x, lo, hi):\n    return x\n",
    ]
    results = grader.grade_many(sources)
    rewards = tuple(r.reward for r in results)
    assert rewards == (1.0, 0.0, 1.0, 0.0)
    assert [r.error for r in results] == [None] * 4
    # The identity passes only the in-range fixture; the swapped nesting passes two by accident.
    assert [r.passed for r in results] == [5, 2, 5, 1]
    assert grader.center(rewards) == (0.5, -0.5, 0.5, -0.5)
    assert grader.has_signal(rewards)
    assert not grader.has_signal((1.0, 1.0, 1.0, 1.0))


@pytest.mark.parametrize("bad", [(), (float("inf"),), (1.0, float("nan"))])
def test_center_rejects_empty_and_non_finite(bad: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="nonempty and finite"):
        grader.center(bad)


def test_result_reward_is_all_or_nothing_and_fraction_is_the_share() -> None:
    partial = grader.GradeResult(3)
    assert (partial.reward, partial.fraction) == (0.0, 0.6)
    assert (grader.GradeResult(5).reward, grader.GradeResult(5).fraction) == (1.0, 1.0)


@pytest.mark.parametrize(("source", "error"), [
    ("def clamp(x, lo, hi)\n    return x\n", "syntax error"),
    ("def clip(x, lo, hi):\n    return min(max(x, lo), hi)\n", "no function named clamp"),
    ("import sys\nsys.exit(0)\n" + CORRECT, "raised SystemExit"),
    ("def clamp(x, lo, hi):\n    data = bytearray(1 << 30)\n    return min(max(x, lo), hi)\n", "memory limit"),
    ("import ctypes\n" + CORRECT, "blocked: ctypes"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n" + CORRECT, "blocked: limits"),
    ("import os\nos.fork()\n" + CORRECT, "blocked: process"),
    ("import gc\ngc.get_objects()\n" + CORRECT, "blocked: introspection"),
    (REBIND_EVERYTHING + "open('x', 'w')\n" + CORRECT, "blocked: file write"),
], ids=["syntax", "no-clamp", "sys-exit", "memory-bomb", "ctypes", "raise-limits", "fork", "gc-walk",
        "rebind-globals"])
def test_broken_or_forbidden_code_scores_zero_with_its_reason(source: str, error: str) -> None:
    assert grader.grade(source) == grader.GradeResult(0, error=error)


def test_infinite_loop_times_out_quickly() -> None:
    start = time.monotonic()
    result = grader.grade("def clamp(x, lo, hi):\n    while True:\n        pass\n", timeout_s=0.5)
    assert result == grader.GradeResult(0, error="timeout")
    assert time.monotonic() - start < 3.0


def test_socket_connect_is_blocked_before_it_reaches_the_listener() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n" + CORRECT
        assert grader.grade(source) == grader.GradeResult(0, error="blocked: network")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("how", [
    "open({path!r}, 'w').write('pwned')",
    "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
    "import pathlib\npathlib.Path({path!r}).touch()",
], ids=["open", "os-open", "pathlib"])
def test_file_write_outside_the_sandbox_is_blocked(tmp_path: Path, how: str) -> None:
    target = tmp_path / "pwned.txt"
    source = "def clamp(x, lo, hi):\n    " + how.format(path=str(target)).replace("\n", "\n    ") + \
        "\n    return min(max(x, lo), hi)\n"
    assert grader.grade(source) == grader.GradeResult(0, error="blocked: file write")
    assert not target.exists()


def test_os_system_is_blocked(tmp_path: Path) -> None:
    target = tmp_path / "marker"
    source = f"import os\nos.system('touch {target}')\n" + CORRECT
    assert grader.grade(source) == grader.GradeResult(0, error="blocked: process")
    assert not target.exists()


def test_child_runs_isolated_in_an_empty_temp_dir_that_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    source = (
        "import os, sys\n"
        f"ok = (os.listdir('.') == [] and os.getcwd().startswith({str(tmp_path)!r}) and sys.flags.isolated\n"
        "      and sys.flags.no_site and set(os.environ) <= {'LC_CTYPE'})\n"
        "def clamp(x, lo, hi):\n"
        "    return min(max(x, lo), hi) if ok else None\n"
    )
    assert grader.grade(source) == grader.GradeResult(5)
    assert list(tmp_path.iterdir()) == []


def test_candidate_output_cannot_forge_a_result() -> None:
    forged = '{"nonce": "guess", "error": null, "outcomes": [{"value": 0}, {"value": 1}, {"value": 2}, ' \
        '{"value": 2}, {"value": -3}]}'
    source = (
        f"import os\nprint({forged!r})\nos.write(3, ({forged!r} + '\\n').encode())\n"
        "def clamp(x, lo, hi):\n    return x\n"
    )
    assert grader.grade(source) == grader.GradeResult(1)


def test_per_fixture_failures_keep_partial_credit() -> None:
    raises = "def clamp(x, lo, hi):\n    if x == 3:\n        raise ValueError\n    return min(max(x, lo), hi)\n"
    assert grader.grade(raises) == grader.GradeResult(3, error="raised ValueError")
    assert grader.grade("def clamp(x, lo, hi):\n    return str(x)\n") == grader.GradeResult(0, error="returned str")
    floats = "def clamp(x, lo, hi):\n    return float(min(max(x, lo), hi))\n"
    assert grader.grade(floats) == grader.GradeResult(5)


@pytest.mark.parametrize("completion", [
    "\n    return min(max(x, lo), hi)\n```\n\nThis function returns lo when x is below lo.",
    "\n    return min(max(x, lo), hi)\n```\n\nExample:\n```python\nprint(clamp(5, 0, 2))\n```",
    "\n    return min(max(x, lo), hi)\n<|im_end|>",
    "\n    return min(max(x, lo), hi)\n",
], ids=["fence-then-chatter", "fence-then-example", "end-of-turn", "cut-off"])
def test_extract_function_cuts_at_the_fence_or_end_of_turn(completion: str) -> None:
    source = grader.extract_function(completion, task.PREFILL)
    assert source == CORRECT
    assert grader.grade(source).reward == 1.0


def test_extract_function_keeps_an_unfenced_prefill_whole() -> None:
    assert grader.extract_function("\n    return x\n```", "def clamp(x, lo, hi):") == \
        "def clamp(x, lo, hi):\n    return x\n"


def test_reference_solution_passes_every_fixture() -> None:
    assert grader.grade(grader.extract_function(task.reference_solution(), task.PREFILL)) == grader.GradeResult(5)


def test_render_chatml_matches_the_smollm2_template() -> None:
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWrite clamp.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert task.render_chatml(task.chat_messages("Write clamp.")) == expected
    # Without a system message the template adds the default one.
    assert task.render_chatml([{"role": "user", "content": "Write clamp."}]) == expected
    assert task.render_chatml(task.chat_messages("Write clamp."), add_generation_prompt=False) == \
        expected.removesuffix("<|im_start|>assistant\n")


def test_prompts_and_prefill() -> None:
    assert len(task.PROMPTS) == len(set(task.PROMPTS)) >= 4
    assert all("clamp(x, lo, hi)" in p for p in task.PROMPTS)
    assert any(task.MINMAX_HINT in p for p in task.PROMPTS)
    assert any(task.MINMAX_HINT not in p for p in task.PROMPTS)
    assert task.PREFILL.startswith("```python\n") and task.PREFILL.endswith("def clamp(x, lo, hi):")
    assert task.render_prompt(task.PROMPTS[0]).endswith("<|im_start|>assistant\n" + task.PREFILL)


def test_sft_examples_are_deterministic_varied_and_all_correct() -> None:
    examples = task.sft_examples(64, seed=0)
    assert examples == task.sft_examples(64, seed=0) != task.sft_examples(64, seed=1)
    assert len(examples) == 64
    assert {p for p, _ in examples} == {task.render_prompt(p) for p in task.PROMPTS}
    for prompt, completion in examples:
        assert completion.endswith("```" + task.END_OF_TURN)
        if task.MINMAX_HINT in prompt:
            assert completion.removesuffix(task.END_OF_TURN) in task.MINMAX_COMPLETIONS
    completions = sorted({c for _, c in examples})
    assert {c.removesuffix(task.END_OF_TURN) for c in completions} == \
        set(task.MINMAX_COMPLETIONS + task.BRANCH_COMPLETIONS)
    sources = [grader.extract_function(c, task.PREFILL) for c in completions]
    assert [r.reward for r in grader.grade_many(sources)] == [1.0] * len(sources)


def test_fixtures_match_a_float64_reference() -> None:
    assert task.FIXTURES == ((-1, 0, 2, 0), (1, 0, 2, 1), (3, 0, 2, 2), (3, 2, 2, 2), (-4, -3, -1, -3))
    assert all(math.isclose(float(e), sorted((float(lo), float(x), float(hi)))[1]) for x, lo, hi, e in task.FIXTURES)
