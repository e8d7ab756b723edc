"""The clamp task: teach a small chat model to write ``clamp(x, lo, hi)``.

Two rooms, both standard-library only:

- ``task`` owns what the model sees: the five fixtures, the prompt variants, the SmolLM2 ChatML
  rendering, the assistant prefill that opens a python fence at ``def clamp(x, lo, hi):``, and
  correct completions for supervised training. It holds no state and runs no code.
- ``grader`` owns what happens to what the model writes: it rebuilds the function source from a
  completion, runs it in a sandboxed ``python -I -S -B`` subprocess (``_sandbox_child``) against the
  fixtures, and turns the outcome into a ``GradeResult`` (all-pass reward, passed fraction, error).
  It owns one temp dir per run, deleted afterwards, and never imports or evaluates candidate code
  in its own process.
"""
