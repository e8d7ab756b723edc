"""Builders the tests share: the datums tests train on (through an SDK, or as the wire's messages made by hand),
and a probe of the ops a computation runs."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lathe
from lathe.v1 import lathe_pb2 as pb


def next_token_datum(tokens: Sequence[int], types: ModuleType = lathe,
                     weights: Sequence[float] | np.ndarray | None = None) -> lathe.Datum:
    """A cross-entropy datum over ``tokens``: the first n-1 as input, each next token its target, every weight 1
    unless ``weights`` (one per target) are given. ``types``: ``lathe`` or ``tinker.types``, whose ``Datum`` and
    ``ModelInput`` take the same arguments."""
    tokens = [int(t) for t in tokens]
    weights = [1.0] * (len(tokens) - 1) if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def rl_datum(prompt: Sequence[int], completion: Sequence[int], logprobs: Sequence[float], advantage: float,
             types: ModuleType = lathe) -> lathe.Datum:
    """A policy-gradient datum (``importance_sampling`` and the like) over ``completion`` sampled after ``prompt``:
    each next token its target, the sampler's ``logprobs`` and ``advantage`` on the completion's targets, 0 on the
    prompt's. ``types`` as for ``next_token_datum``."""
    tokens = [*prompt, *completion]
    n = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": [0.0] * n + list(logprobs),
        "advantages": [0.0] * n + [advantage] * len(completion)})


def pb_tensor(values: Sequence | np.ndarray, dtype: str, shape: list[int] | None = None) -> pb.Tensor:
    """``values`` as the wire's ``pb.Tensor`` of ``dtype``, with their own shape unless ``shape`` says otherwise (a
    hostile test may declare one that does not fit)."""
    arr = np.asarray(values, dtype=dtype)
    return pb.Tensor(data=arr.tobytes(), dtype=dtype, shape=list(arr.shape) if shape is None else shape)


def next_token_pb_datum(tokens: Sequence[int]) -> pb.Datum:
    """``next_token_datum`` as the wire's ``pb.Datum`` (int64 targets, fp32 weights), for calls made by hand."""
    tokens = [int(t) for t in tokens]
    return pb.Datum(model_input=pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=tokens[:-1])]),
                    loss_fn_inputs={"target_tokens": pb_tensor(tokens[1:], "int64"),
                                    "weights": pb_tensor([1.0] * (len(tokens) - 1), "float32")})


def pb_datum(tokens: list[int], **inputs: pb.Tensor) -> pb.Datum:
    """A ``pb.Datum`` made by hand for an engine or a door: every token as input, each target the next token (the
    last one's the first), every weight 1; ``inputs`` add loss inputs or replace these."""
    inputs = {"target_tokens": pb_tensor(tokens[1:] + tokens[:1], "int64"),
              "weights": pb_tensor([1.0] * len(tokens), "float32"), **inputs}
    return pb.Datum(model_input=pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=tokens)]), loss_fn_inputs=inputs)


class CrossDtype(TorchDispatchMode):
    """Records every op (on this thread, while entered) that reads floating tensors of more than one dtype, casts
    excepted: a bf16 + fp32 elementwise op runs several times slower than an upcast and a one-dtype op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        floats = {a.dtype for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 0}
        if len(floats) > 1 and func not in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            self.seen.append(f"{func}: {sorted(map(str, floats))}")
        return func(*args, **kwargs)
