"""The clamp task and its sandboxed grader: rewards, failure verdicts, side effects, extraction.

Every sandbox test runs a real child process; candidates that misbehave are otherwise correct, so a
missing block would show up as reward 1 or as a file that exists.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import tempfile
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
    ("import ctypes\n" + CORRECT, "blocked: import"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n" + CORRECT, "blocked: resource.setrlimit"),
    ("import os\nos.fork()\n" + CORRECT, "blocked: os.fork"),
    ("import gc\ngc.get_objects()\n" + CORRECT, "blocked: import"),
    ("import sys\nsys.modules['gc'].get_objects()\n" + CORRECT, "raised KeyError"),
    (REBIND_EVERYTHING + "open('x', 'w')\n" + CORRECT, "blocked: open"),
], ids=["syntax", "no-clamp", "sys-exit", "memory-bomb", "ctypes", "raise-limits", "fork", "gc-import", "gc-loaded",
        "rebind-globals"])
def test_broken_or_forbidden_code_scores_zero_with_its_reason(source: str, error: str) -> None:
    assert grader.grade(source) == grader.GradeResult(0, error=error)


def test_an_infinite_loop_scores_zero_as_a_timeout() -> None:
    result = grader.grade("def clamp(x, lo, hi):\n    while True:\n        pass\n", timeout_s=0.5)
    assert result == grader.GradeResult(0, error="timeout")


def test_socket_connect_is_blocked_before_it_reaches_the_listener() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n" + CORRECT
        assert grader.grade(source) == grader.GradeResult(0, error="blocked: import")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize(("how", "error"), [
    ("open({path!r}, 'w').write('pwned')", "blocked: open"),
    ("import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))", "blocked: open"),
    ("import pathlib\npathlib.Path({path!r}).touch()", "blocked: import"),
], ids=["open", "os-open", "pathlib"])
def test_file_write_outside_the_sandbox_is_blocked(tmp_path: Path, how: str, error: str) -> None:
    target = tmp_path / "pwned.txt"
    source = "def clamp(x, lo, hi):\n    " + how.format(path=str(target)).replace("\n", "\n    ") + \
        "\n    return min(max(x, lo), hi)\n"
    assert grader.grade(source) == grader.GradeResult(0, error=error)
    assert not target.exists()


def test_os_system_is_blocked(tmp_path: Path) -> None:
    target = tmp_path / "marker"
    source = f"import os\nos.system('touch {target}')\n" + CORRECT
    assert grader.grade(source) == grader.GradeResult(0, error="blocked: os.system")
    assert not target.exists()


def test_child_runs_isolated_in_an_empty_temp_dir_that_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No environment (so no secret of the grader's), a fresh working directory, isolated mode, not root,
    and hard limits on memory, CPU, file size, open files and processes."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("LATHE_GRADER_SECRET", "do-not-leak")
    source = (
        "import os, sys, resource\n"
        "limits = {w: resource.getrlimit(getattr(resource, 'RLIMIT_' + w)) for w in\n"
        "          ('AS', 'CPU', 'FSIZE', 'NOFILE', 'NPROC', 'CORE')}\n"
        f"ok = (os.getcwd().startswith({str(tmp_path)!r}) and sys.flags.isolated and sys.flags.no_site\n"
        "      and set(os.environ) <= {'LC_CTYPE'} and os.getuid() != 0 and os.geteuid() != 0\n"
        "      and limits == {'AS': (256 << 20,) * 2, 'CPU': (2, 2), 'FSIZE': (1 << 20,) * 2, 'NOFILE': (16, 16),\n"
        "                     'NPROC': (0, 0), 'CORE': (0, 0)})\n"
        "def clamp(x, lo, hi):\n"
        "    return min(max(x, lo), hi) if ok else None\n"
    )
    assert grader.grade(source) == grader.GradeResult(5)
    assert list(tmp_path.iterdir()) == []


MARKER = str(Path(tempfile.gettempdir()) / "lathe-sandbox-escaped")  # what an escape below would write
ESCAPE = f"\nopen({MARKER!r}, 'w').write('escaped')\n"


@pytest.mark.parametrize(("attack", "error"), [
    # the attack: the sandbox script's frame, then its reporter's code replaced, so the hook stops ending
    # the run
    ("import sys\nrep = sys._getframe(1).f_locals['report']\nrep.__code__ = (lambda e, o: None).__code__",
     "blocked: sys._getframe"),
    ("try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    f = e.__traceback__.tb_frame.f_back",
     "blocked: object.__getattr__"),
    ("def g():\n    yield\nf = g().gi_frame", "blocked: object.__getattr__"),
    ("import sys\nsys.settrace(lambda *a: None)", "blocked: sys.settrace"),
    ("import sys\nsys.setprofile(lambda *a: None)", "blocked: sys.setprofile"),
    ("import sys\nsys._current_frames()", "blocked: sys._current_frames"),
    ("import __main__\n__main__.make_reporter.__code__ = (lambda *a: None).__code__",
     "blocked: object.__getattr__"),
    # the allow-list is the hook's own: rebinding the script's global changes nothing
    ("import __main__\n__main__.ALLOWED_EVENTS = frozenset({'open', 'exec', 'compile'})", "blocked: open"),
    ("import sys\nsys.addaudithook(lambda *a: None)", "blocked: sys.addaudithook"),
], ids=["getframe-f_locals", "traceback-frame", "generator-frame", "settrace", "setprofile", "current-frames",
        "replace-code", "rebind-allow-list", "second-hook"])
def test_code_cannot_switch_the_sandbox_off(attack: str, error: str) -> None:
    Path(MARKER).unlink(missing_ok=True)
    assert grader.grade(attack + ESCAPE + CORRECT) == grader.GradeResult(0, error=error)
    assert not Path(MARKER).exists()


@pytest.mark.parametrize("read", [
    "import os\nopen(f'/proc/{os.getppid()}/environ', 'rb').read()",
    "open('/etc/passwd').read()",
    "import os\nos.read(os.open('/etc/hostname', os.O_RDONLY), 100)",
    "import io\nio.open_code('/etc/passwd').read()",
    "import os\nos.listdir('/')",
    "import os\nlist(os.scandir('/tmp'))",
], ids=["parent-environ", "open", "os-open", "open-code", "listdir", "scandir"])
def test_candidate_reads_no_file(read: str) -> None:
    result = grader.grade(read + "\n" + CORRECT)
    assert result.passed == 0 and result.error is not None and result.error.startswith("blocked: ")


def test_honest_code_with_the_allowed_modules_passes() -> None:
    source = (
        "import math, functools, itertools, operator, typing, collections, numbers, cmath\n"
        "from functools import reduce\n"
        "def clamp(x: typing.Any, lo, hi):\n"
        "    assert isinstance(x, numbers.Real) and not math.isnan(x) and id(x)\n"
        "    return reduce(lambda a, f: f(a), [functools.partial(max, lo), functools.partial(min, hi)], x)\n"
    )
    assert grader.grade(source) == grader.GradeResult(5)


def test_the_network_namespace_alone_keeps_the_child_off_the_host_network() -> None:
    """Without the audit hook, a process started with the grader's prefix still reaches no listener."""
    prefix = grader.network_namespace()
    if not prefix:
        pytest.skip("unshare is not available or not permitted here")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        proc = subprocess.run([*prefix, sys.executable, "-I", "-c", code], capture_output=True, timeout=30)
        assert proc.returncode != 0
        assert b"OSError" in proc.stderr or b"Error" in proc.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


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
