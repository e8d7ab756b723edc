"""The Tinker HTTP door's binary messages (``lathe.v1.tinker_public``) <-> ``lathe.v1`` messages.

In: a ``ForwardBackwardRequest`` body becomes the core's ``ForwardBackwardRequest`` (text chunks to token
ids, sparse CSR tensors densified, ``loss_fn_config_v2`` preferred over the old map). Out: the trainer's
per-datum ``logprobs`` become one batched ``ArrayRecord``, and a sampler result becomes a ``SampleResponse``
(dense top-k matrices, NaN where no prompt logprob was computed). Every array is raw little-endian bytes;
anything the door cannot serve is an ``InvalidArgument`` naming the field. Shapes are checked before any
array is built (no negative dimension, at most ``MAX_DIMS``), and a request's tensors may hold at most
``max_elements`` values once dense: a sparse tensor of shape ``[1, 10**10]`` is refused, not densified.
"""

from __future__ import annotations

import math

import numpy as np
from google.protobuf.message import DecodeError

from lathe.errors import InvalidArgument
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import tinker_public_pb2 as tp

PROTO_CONTENT_TYPE = "application/x-protobuf"
TOPK_EMPTY_ID, TOPK_EMPTY_LOGPROB = 0, -99999.0  # Tinker's filler for positions without top-k logprobs

_DTYPES: dict[int, str] = {tp.DTYPE_FLOAT32: "float32", tp.DTYPE_INT64: "int64", tp.DTYPE_INT32: "int32"}
_PROTO_DTYPES = {name: code for code, name in _DTYPES.items()}
_STOP_REASONS = {"stop": tp.STOP_REASON_STOP, "length": tp.STOP_REASON_LENGTH}
MAX_DIMS = 8  # as the trainer's check of a tensor (lathe.trainer.validate)


def _array(data: bytes, dtype: str, where: str) -> np.ndarray:
    item = np.dtype(dtype).newbyteorder("<")
    if len(data) % item.itemsize:
        raise InvalidArgument(f"{where}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=item)


class _Budget:
    """How many more tensor values a request may hold once dense."""

    def __init__(self, max_elements: int) -> None:
        self.max_elements = self.left = max_elements

    def take(self, n: int, where: str) -> None:
        if n > self.left:
            raise InvalidArgument(f"{where} holds {n} values once dense; a request may hold at most "
                                  f"{self.max_elements} in its loss_fn_inputs ({self.left} left)")
        self.left -= n


def _tensor(t: tp.Tensor, where: str, budget: _Budget) -> pb.Tensor:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        name = tp.DType.Name(t.dtype) if t.dtype in tp.DType.values() else str(t.dtype)
        raise InvalidArgument(f"{where}.dtype = {name} is not one of {[tp.DType.Name(c) for c in _DTYPES]}")
    shape = list(t.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise InvalidArgument(f"{where}.shape = {shape} is not a shape (at most {MAX_DIMS} dimensions, "
                              "none negative)")
    if t.WhichOneof("encoding") != "sparse_csr":
        budget.take(len(t.dense) // np.dtype(dtype).itemsize, where)
        return pb.Tensor(data=t.dense, dtype=dtype, shape=shape)
    if len(shape) != 2:
        raise InvalidArgument(f"{where}.sparse_csr needs a 2-D shape, got {shape}")
    budget.take(math.prod(shape), where)
    csr = t.sparse_csr
    values = _array(csr.values, dtype, f"{where}.sparse_csr.values")
    crow = _array(csr.crow_indices, "int64", f"{where}.sparse_csr.crow_indices")
    col = _array(csr.col_indices, "int64", f"{where}.sparse_csr.col_indices")
    if len(crow) != shape[0] + 1 or len(col) != len(values) or \
            (crow.size and (crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0))) or \
            np.any((col < 0) | (col >= shape[1])):
        raise InvalidArgument(f"{where}.sparse_csr is not a valid CSR layout of shape {shape}")
    dense = np.zeros(shape, dtype=values.dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return pb.Tensor(data=dense.tobytes(), dtype=dtype, shape=shape)


def _tokens(d: tp.Datum, where: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(f"{where}.model_input[{j}] is a {kind or 'empty'} chunk; this server serves "
                                  "text models, whose inputs are encoded_text chunks")
        tokens += _array(chunk.encoded_text.tokens, "int32", f"{where}.model_input[{j}].tokens").tolist()
    return tokens


def _loss_config(req: tp.ForwardBackwardRequest) -> dict[str, float]:
    if not req.loss_fn_config_v2:
        return dict(req.loss_fn_config)
    config = {}
    for key, value in req.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise InvalidArgument(f"loss_fn_config[{key!r}] = {value.text!r} is text; loss {req.loss_fn!r} "
                                  "takes numbers only")
        config[key] = value.number
    return config


def forward_backward_from_proto(body: bytes, max_elements: int) -> pb.ForwardBackwardRequest:
    """Decode a ``/forward_backward`` body for ``GatewayCore.submit``; its tensors may hold at most
    ``max_elements`` values once dense."""
    req = tp.ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as e:
        raise InvalidArgument(f"the request body is not a valid tinker_public.ForwardBackwardRequest: {e}") from None
    data = []
    budget = _Budget(max_elements)
    for i, d in enumerate(req.data):
        where = f"data[{i}]"
        chunk = pb.ModelInputChunk(tokens=_tokens(d, where))
        inputs = {name: _tensor(t, f"{where}.loss_fn_inputs[{name!r}]", budget)
                  for name, t in d.loss_fn_inputs.items()}
        data.append(pb.Datum(model_input=pb.ModelInput(chunks=[chunk]), loss_fn_inputs=inputs))
    return pb.ForwardBackwardRequest(model_id=req.model_id, seq_id=req.seq_id, data=data, loss_fn=req.loss_fn,
                                     loss_fn_config=_loss_config(req), forward_only=req.forward_only)


def forward_backward_output_to_proto(out: pb.ForwardBackwardOutput) -> bytes:
    """The trainer's per-datum tensors as one ``ArrayRecord`` of batched fields, plus the metrics."""
    record = tp.ArrayRecord(type_tag=out.loss_fn_output_type, num_datums=len(out.loss_fn_outputs))
    names = out.loss_fn_outputs[0].tensors.keys() if out.loss_fn_outputs else ()
    for name in names:
        tensors = [o.tensors[name] for o in out.loss_fn_outputs]
        offsets = np.cumsum([0] + [len(t.data) for t in tensors], dtype=np.int64)
        record.fields[name].CopyFrom(tp.BatchedTensor(
            data=b"".join(t.data for t in tensors), offsets=offsets.astype("<i8").tobytes(),
            dtype=_PROTO_DTYPES[tensors[0].dtype], trailing_shape=list(tensors[0].shape)[1:]))
    msg = tp.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type, metrics=dict(out.metrics))
    if out.loss_fn_outputs:
        msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


def _f32(values: list[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _topk(entries: list[pb.TopkLogprobs], k: int, scored_from: int) -> tp.TopkLogprobs:
    ids = np.full((len(entries), k), TOPK_EMPTY_ID, dtype="<i4")
    lps = np.full((len(entries), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, e in enumerate(entries[scored_from:], start=scored_from):
        n = min(k, len(e.token_ids))
        ids[i, :n], lps[i, :n] = e.token_ids[:n], e.logprobs[:n]
    return tp.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(entries))


def sample_response_to_proto(out: pb.SampleOutput, topk: int, last_n: int | None) -> bytes:
    """A sampler result as Tinker's ``SampleResponse``. ``last_n``: only the last ``last_n`` prompt positions
    keep their (top-k) logprobs, as ``prompt_logprobs_last_n`` asks; the others read as not computed."""
    msg = tp.SampleResponse(sequences=[
        tp.SampledSequence(stop_reason=_STOP_REASONS[s.stop_reason], tokens=np.asarray(s.tokens, "<i4").tobytes(),
                           logprobs=_f32(s.logprobs))
        for s in out.sequences])
    n = len(out.prompt_logprobs) or len(out.topk_prompt_logprobs)
    scored_from = n - last_n if last_n is not None else 0
    if out.prompt_logprobs:
        lps = np.asarray(out.prompt_logprobs, dtype=np.float32)
        lps[:scored_from] = math.nan
        msg.prompt_logprobs = _f32(lps)
    if topk and out.topk_prompt_logprobs:
        msg.topk_prompt_logprobs.CopyFrom(_topk(list(out.topk_prompt_logprobs), topk, scored_from))
    return msg.SerializeToString()
