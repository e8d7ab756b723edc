"""What a datum is made of: ``ModelInput`` (a list of ``EncodedTextChunk``), ``TensorData`` (a flat array + dtype +
shape, from and to numpy and torch) and ``Datum`` (model input + ``loss_fn_inputs``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch


TensorDtype = Literal["int64", "float32", "int32"]
NUMPY_DTYPES: dict[str, type[np.generic]] = {"int64": np.int64, "float32": np.float32, "int32": np.int32}

# The dtype Tinker gives a plain-list loss input of each known key (other keys: by the values' kind).
LOSS_INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
}


@dataclass(slots=True)
class EncodedTextChunk:
    """A run of token ids."""

    tokens: Sequence[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ModelInput:
    """The tokens a model reads, as chunks (only encoded text for now)."""

    chunks: list[EncodedTextChunk]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [int(t) for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        """The number of context positions this input takes."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        """A new ModelInput with ``chunk`` added at the end."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        """A new ModelInput with one more token."""
        return self.append(EncodedTextChunk(tokens=[token]))


def _dtype_of_kind(kind: str, what: str) -> TensorDtype:
    """Tinker's rule: floating point -> float32, integers and booleans -> int64."""
    if kind == "f":
        return "float32"
    if kind in "iub":
        return "int64"
    raise ValueError(f"{what} has element kind {kind!r}; expected numbers")


@dataclass(slots=True, eq=False)
class TensorData:
    """A dense tensor: flat ``data`` (list or numpy array), ``dtype`` and ``shape`` (None: 1-D).

    Equality compares dtype, shape and values.
    """

    data: list[int] | list[float] | np.ndarray
    dtype: TensorDtype
    shape: list[int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"TensorData.dtype = {self.dtype!r}; expected one of {sorted(NUMPY_DTYPES)}")
        if isinstance(self.data, np.ndarray) and self.data.ndim != 1:
            if self.shape is None:
                self.shape = list(self.data.shape)
            self.data = self.data.reshape(-1)
        if self.shape is not None:
            self.shape = [int(d) for d in self.shape]
            if any(d < 0 for d in self.shape):
                raise ValueError(f"TensorData.shape = {self.shape} has a negative dimension")
            if math.prod(self.shape) != len(self.data):
                raise ValueError(f"TensorData.shape = {self.shape} holds {math.prod(self.shape)} values, "
                                 f"but data has {len(self.data)}")

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = _dtype_of_kind(array.dtype.kind, f"numpy array of dtype {array.dtype}")
        return cls(data=array.astype(NUMPY_DTYPES[dtype]).reshape(-1), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        import torch

        dtype: TensorDtype = "float32" if tensor.dtype.is_floating_point else "int64"
        flat = tensor.detach().to("cpu", getattr(torch, dtype)).reshape(-1).numpy()
        return cls(data=flat, dtype=dtype, shape=list(tensor.shape))

    def to_numpy(self) -> np.ndarray:
        arr = np.asarray(self.data, dtype=NUMPY_DTYPES[self.dtype])
        return arr.reshape(self.shape) if self.shape is not None else arr

    def to_torch(self) -> torch.Tensor:
        import torch

        return torch.tensor(self.to_numpy())

    def tolist(self) -> list[Any]:
        return self.to_numpy().tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorData):
            return NotImplemented
        a, b = self.to_numpy(), other.to_numpy()
        return self.dtype == other.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if its creator imported torch
    return torch is not None and isinstance(value, torch.Tensor)


def as_tensor_data(key: str, value: object) -> TensorData:
    """One ``loss_fn_inputs`` value as TensorData, converted the way Tinker's ``Datum`` does.

    numpy arrays and torch tensors keep their kind (floating -> float32, integer -> int64); plain lists take
    the dtype of their key (``target_tokens`` int64; ``weights``, ``advantages``, ``logprobs`` float32) or,
    for other keys, of their values.
    """
    if isinstance(value, TensorData):
        return value
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if _is_torch_tensor(value):
        return TensorData.from_torch(value)
    if isinstance(value, list | tuple):
        what = f"loss_fn_inputs[{key!r}]"
        try:
            array = np.asarray(value)
        except ValueError:  # ragged nesting
            array = np.asarray(None)
        if array.dtype == object:
            raise ValueError(f"{what} must be a rectangular array of numbers")
        dtype = LOSS_INPUT_DTYPES.get(key) or _dtype_of_kind(array.dtype.kind, what)
        return TensorData.from_numpy(array.astype(NUMPY_DTYPES[dtype]))
    raise TypeError(f"loss_fn_inputs[{key!r}] is a {type(value).__name__}; expected TensorData, "
                    "a numpy array, a torch tensor or a list of numbers")


@dataclass(slots=True)
class Datum:
    """One training example: the model input and the loss function's per-token inputs.

    ``loss_fn_inputs`` values may be TensorData, numpy arrays, torch tensors or lists; the constructor
    converts them (see ``as_tensor_data``).
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    def __post_init__(self) -> None:
        self.loss_fn_inputs = {k: as_tensor_data(k, v) for k, v in self.loss_fn_inputs.items()}
