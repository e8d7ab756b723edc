"""Datum checks: every datum of a forward / forward_backward is decoded from protobuf and checked against its
run's ``Limits`` as the request arrives (``lathe.trainer.intake``), before it is queued.

A rejected request raises ``lathe.errors.InvalidArgument`` whose message names the datum index, the
field and the lengths or values at fault; nothing has been queued, computed or changed at that point.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from lathe.errors import InvalidArgument
from lathe.loss_graph import LossGraph
from lathe.trainer.losses import LOSSES
from lathe.trainer.ops import Example, Limits
from lathe.v1 import lathe_pb2 as pb

_NP_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32}
_INT_FIELDS = ("target_tokens",)
MAX_DIMS = 8  # dimensions of one tensor


def check_shape(shape: Sequence[int], size: int, where: str) -> tuple[int, ...]:
    """``shape`` as a tuple once it is a real shape of ``size`` values: at most ``MAX_DIMS`` dimensions, none
    negative, whose product is ``size`` (``[-2, -3]`` multiplies to 6 and is still refused)."""
    dims = tuple(shape)
    if len(dims) > MAX_DIMS:
        raise InvalidArgument(f"{where}: shape {list(dims)} has {len(dims)} dimensions, over the limit of {MAX_DIMS}")
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{where}: shape {list(dims)} has a negative dimension")
    if math.prod(dims) != size:
        raise InvalidArgument(f"{where}: shape {list(dims)} does not hold {size} values")
    return dims


def decode_tensor(t: pb.Tensor, where: str) -> np.ndarray:
    if t.dtype not in _NP_DTYPES:
        raise InvalidArgument(f"{where}: dtype {t.dtype!r} is not one of {sorted(_NP_DTYPES)}")
    itemsize = np.dtype(_NP_DTYPES[t.dtype]).itemsize
    if len(t.data) % itemsize:
        raise InvalidArgument(f"{where}: {len(t.data)} bytes is not a whole number of {t.dtype} values")
    arr = np.frombuffer(t.data, dtype=_NP_DTYPES[t.dtype])
    return arr.reshape(check_shape(t.shape or (arr.size,), arr.size, where))


def _tokens(d: pb.Datum, i: int) -> list[int]:
    tokens = [t for c in d.model_input.chunks for t in c.tokens]
    if not tokens:
        raise InvalidArgument(f"datum {i}: model_input is empty")
    return tokens


def _check_ids(values: np.ndarray | list[int], field: str, i: int, vocab: int) -> None:
    arr = np.asarray(values)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab))
    if bad.size:
        j = int(bad[0])
        raise InvalidArgument(f"datum {i}: {field}[{j}] = {int(arr[j])} is outside the vocabulary [0, {vocab})")


def _input_array(full: np.ndarray, rank: int, n: int, where: str) -> np.ndarray:
    """A loss input of declared ``rank`` for a datum of ``n`` tokens: [] (one value), [n] or [n, K]."""
    if rank == 0:
        if full.size != 1:
            raise InvalidArgument(f"{where} has {full.size} values; the loss declared it rank 0 (one value)")
        return full.reshape(())
    if rank == 2:
        if full.ndim != 2 or full.shape[0] != n:
            raise InvalidArgument(f"{where} has shape {list(full.shape)}; the loss declared it rank 2 ([{n}, K] for "
                                  f"model_input's {n} tokens)")
        return full
    if full.size != n:
        raise InvalidArgument(f"{where} has length {full.size} but model_input has {n} tokens")
    return full.reshape(-1)


def check_datum(d: pb.Datum, i: int, loss_fn: str, limits: Limits, custom: LossGraph | None = None) -> Example:
    """One datum for loss ``loss_fn`` (``custom``: the checked graph of a "custom" loss, whose inputs have the
    ranks it declares; a built-in loss's inputs are all [L])."""
    if custom is not None:
        required, optional, ranks = custom.input_names, (), dict(custom.inputs[1:])
    else:
        spec = LOSSES[loss_fn]
        required, optional, ranks = spec.inputs, spec.optional, {}
    tokens = _tokens(d, i)
    n = len(tokens)
    if n > limits.max_context:
        raise InvalidArgument(f"datum {i}: model_input has {n} tokens, over the model's context length "
                              f"{limits.max_context}")
    _check_ids(tokens, "model_input", i, limits.vocab_size)
    allowed = {"target_tokens", *required, *optional}
    unknown = sorted(set(d.loss_fn_inputs) - allowed)
    if unknown:
        raise InvalidArgument(f"datum {i}: loss_fn_inputs has unknown key(s) {unknown} for loss {loss_fn!r} "
                              f"(expected {sorted(allowed)})")
    if "target_tokens" not in d.loss_fn_inputs:
        raise InvalidArgument(f"datum {i}: loss_fn_inputs is missing 'target_tokens'")
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in d.loss_fn_inputs.items():
        where = f"datum {i}: loss_fn_inputs[{name!r}]"
        full = decode_tensor(tensor, where)
        arr = full.reshape(-1)
        is_int = arr.dtype.kind == "i"
        if name in _INT_FIELDS and not is_int:
            raise InvalidArgument(f"{where}: dtype {tensor.dtype} must be int64 (token ids)")
        if name not in _INT_FIELDS and is_int:
            raise InvalidArgument(f"{where}: dtype {tensor.dtype} must be float32")
        if not is_int and not np.isfinite(arr).all():
            j = int(np.flatnonzero(~np.isfinite(arr))[0])
            raise InvalidArgument(f"{where}[{j}] = {arr[j]} is not finite")
        if name == "logprobs" and (arr > 0).any():
            j = int(np.flatnonzero(arr > 0)[0])
            raise InvalidArgument(f"{where}[{j}] = {arr[j]} is positive; sampled logprobs are log-probabilities "
                                  "(<= 0)")
        arrays[name] = _input_array(full, ranks.get(name, 1), n, where)
    missing = [k for k in required if k not in arrays and not (loss_fn == "cross_entropy" and k == "weights")]
    if missing:
        raise InvalidArgument(f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs {missing}")
    _check_ids(arrays["target_tokens"], "loss_fn_inputs['target_tokens']", i, limits.vocab_size)
    inputs = {k: torch.from_numpy(v.astype(np.float32)) for k, v in arrays.items() if k != "target_tokens"}
    if loss_fn == "cross_entropy" and "weights" not in inputs:
        inputs["weights"] = torch.ones(n)
    return Example(tokens, torch.from_numpy(arrays["target_tokens"].astype(np.int64)), inputs)


def check_request(
    data: Sequence[pb.Datum], loss_fn: str, loss_fn_config: Mapping[str, float], limits: Limits,
    custom: LossGraph | None = None
) -> tuple[list[Example], dict[str, float]]:
    """Decode and check a whole forward/backward request; returns the examples and the loss config.
    ``custom``: the checked graph when ``loss_fn`` is "custom" (which takes no loss_fn_config)."""
    if loss_fn not in LOSSES and not (loss_fn == "custom" and custom is not None):
        raise InvalidArgument(f"unknown loss_fn {loss_fn!r}; supported: {sorted(LOSSES)}, or 'custom' with a "
                              "custom loss")
    if not data:
        raise InvalidArgument("data is empty: a forward/backward needs at least one datum")
    defaults = LOSSES[loss_fn].config if custom is None else {}
    unknown = sorted(set(loss_fn_config) - set(defaults))
    if unknown:
        raise InvalidArgument(f"loss_fn_config has unknown key(s) {unknown} for loss {loss_fn!r} "
                              f"(accepted: {sorted(defaults)})")
    cfg = {**defaults, **{k: float(v) for k, v in loss_fn_config.items()}}
    bad = [k for k, v in cfg.items() if not math.isfinite(v) or v < 0]
    if bad:
        raise InvalidArgument(f"loss_fn_config[{bad[0]!r}] = {cfg[bad[0]]} must be a finite number >= 0")
    if cfg.get("clip_low_threshold", 0.0) > cfg.get("clip_high_threshold", math.inf):
        raise InvalidArgument(f"loss_fn_config: clip_low_threshold = {cfg['clip_low_threshold']} is above "
                              f"clip_high_threshold = {cfg['clip_high_threshold']}")
    total = sum(len(_tokens(d, i)) for i, d in enumerate(data))
    if total > limits.max_request_tokens:
        raise InvalidArgument(f"request has {total} tokens in {len(data)} datums, over the limit of "
                              f"{limits.max_request_tokens} tokens per request; send it in smaller batches")
    return [check_datum(d, i, loss_fn, limits, custom) for i, d in enumerate(data)], cfg
