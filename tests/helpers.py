"""Builders the tests share: the datums most tests train on, and a probe of the ops a computation runs."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lathe
from lathe.v1 import lathe_pb2 as pb


def next_token_datum(tokens: Sequence[int], types: ModuleType = lathe) -> lathe.Datum:
    """A cross-entropy datum over ``tokens``: the first n-1 as input, each next token its target, every weight 1.
    ``types``: ``lathe`` or ``tinker.types``, whose ``Datum`` and ``ModelInput`` take the same arguments."""
    tokens = [int(t) for t in tokens]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def next_token_pb_datum(tokens: Sequence[int]) -> pb.Datum:
    """``next_token_datum`` as the wire's ``pb.Datum`` (int64 targets, fp32 weights), for calls made by hand."""
    tokens = [int(t) for t in tokens]

    def tensor(values: list, dtype: str) -> pb.Tensor:
        return pb.Tensor(data=np.asarray(values, dtype=dtype).tobytes(), dtype=dtype, shape=[len(values)])

    return pb.Datum(model_input=pb.ModelInput(chunks=[pb.ModelInputChunk(tokens=tokens[:-1])]),
                    loss_fn_inputs={"target_tokens": tensor(tokens[1:], "int64"),
                                    "weights": tensor([1.0] * (len(tokens) - 1), "float32")})


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
