"""The Tinker HTTP door's binary messages (``lathe.v1.tinker_public``) <-> ``lathe.v1`` messages.

In: a ``ForwardBackwardRequest`` body becomes the core's ``ForwardBackwardRequest`` (text chunks to token
ids, sparse CSR tensors densified, ``loss_fn_config_v2`` preferred over the old map, provenance spans checked
for ``stable_reinforce`` and otherwise not needed). Out: the trainer's
per-datum ``logprobs`` become one batched ``ArrayRecord``, and a sampler result becomes a ``SampleResponse``
(dense top-k matrices, NaN where no prompt logprob was computed; a sparse ``target_prompt_logprobs`` request
answered in its own layout). Every array is raw little-endian bytes;
anything the door cannot serve is an ``InvalidArgument`` naming the field. Shapes are checked before any
array is built (no negative dimension, at most ``MAX_DIMS``), and a request's tensors may hold at most
``max_elements`` values once dense: a sparse tensor of shape ``[1, 10**10]`` is refused, not densified; its
token ids are counted from their byte lengths before they become a list. The body is parsed first
(``parse_forward_backward``), so a door knows the ``model_id`` and ``seq_id`` of a request it then refuses.
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


def _tensor(t: tp.Tensor, where: str, budget: _Budget, pad: int = 0) -> pb.Tensor:
    """``t`` dense, a sparse one with ``pad`` in every cell it does not list."""
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
    dense = np.full(shape, pad, dtype=values.dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return pb.Tensor(data=dense.tobytes(), dtype=dtype, shape=shape)


def target_ids(t: tp.Tensor, max_elements: int) -> pb.Tensor:
    """A sample's ``target_prompt_logprobs`` ids, dense; a sparse one gets -1 (asks for nothing) where unlisted."""
    return _tensor(t, "target_prompt_logprobs", _Budget(max_elements), pad=-1)


def _tokens(d: tp.Datum, where: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(f"{where}.model_input[{j}] is a {kind or 'empty'} chunk; this server serves "
                                  "text models, whose inputs are encoded_text chunks")
        tokens += _array(chunk.encoded_text.tokens, "int32", f"{where}.model_input[{j}].tokens").tolist()
    return tokens


def _custom_loss_id(req: tp.ForwardBackwardRequest) -> str:
    """A ``custom`` request's ``loss_fn_config``: exactly ``{"loss_id": <text>}`` (tinker's uploaded loss)."""
    value = req.loss_fn_config_v2.get("loss_id")
    if set(req.loss_fn_config_v2) != {"loss_id"} or req.loss_fn_config or value.WhichOneof("value") != "text":
        raise InvalidArgument("loss_fn 'custom' takes loss_fn_config {'loss_id': <the id create_custom_loss "
                              f"answered>}} and nothing else, got keys {sorted(req.loss_fn_config_v2)}")
    return value.text


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


def _spans_cover(spans: list[tp.ProvenanceSpan], length: int, where: str) -> None:
    total = 0
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        run = getattr(span, kind) if kind else None
        if run is None or not run.sequence_id or run.offset < 0 or run.length < 0:
            raise InvalidArgument(f"{where}[{j}] is not a provenance run (a prompt_tokens or sampled_tokens run "
                                  "with a sequence_id, offset >= 0 and length >= 0)")
        total += run.length
    if total != length:
        raise InvalidArgument(f"{where} covers {total} positions but the field has {length}; the runs must tile it")


def _check_provenance(d: tp.Datum, n_tokens: int, where: str) -> None:
    """``stable_reinforce`` needs every datum to name the sampled sequences behind its tokens, as Tinker does; here
    the runs are checked for shape (each tiles its field), and ``lathe.gateway.stability`` then checks them against
    the records and takes the behaviour logprobs from there."""
    if not d.model_input_spans or not d.loss_fn_input_spans:
        raise InvalidArgument(f"{where} has no provenance: loss 'stable_reinforce' needs model_input_spans and "
                              "loss_fn_input_spans naming the sampled sequences (Datum.with_provenance)")
    targets = d.loss_fn_inputs["target_tokens"].shape if "target_tokens" in d.loss_fn_inputs else []
    _spans_cover(list(d.model_input_spans), n_tokens, f"{where}.model_input_spans")
    _spans_cover(list(d.loss_fn_input_spans), targets[0] if len(targets) == 1 else n_tokens,
                 f"{where}.loss_fn_input_spans")


def parse_forward_backward(body: bytes) -> tp.ForwardBackwardRequest:
    """A ``/forward_backward`` body as Tinker's message (``forward_backward_from_proto`` checks and converts it)."""
    req = tp.ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as e:
        raise InvalidArgument(f"the request body is not a valid tinker_public.ForwardBackwardRequest: {e}") from None
    return req


def forward_backward_from_proto(req: tp.ForwardBackwardRequest, max_elements: int, max_tokens: int
                                ) -> pb.ForwardBackwardRequest:
    """The core's request for ``Runs.submit``: its tensors may hold at most ``max_elements`` values once
    dense, and its model inputs at most ``max_tokens`` token ids, counted before any list of them is built."""
    tokens = sum(len(c.encoded_text.tokens) // 4 for d in req.data for c in d.model_input)
    if tokens > max_tokens:
        raise InvalidArgument(f"the request's model inputs hold {tokens} token ids, over the limit of {max_tokens} "
                              "(max_request_tokens)")
    data = []
    budget = _Budget(max_elements)
    for i, d in enumerate(req.data):
        where = f"data[{i}]"
        chunk = pb.ModelInputChunk(tokens=_tokens(d, where))
        if req.loss_fn == "stable_reinforce":
            _check_provenance(d, len(chunk.tokens), where)
        inputs = {name: _tensor(t, f"{where}.loss_fn_inputs[{name!r}]", budget)
                  for name, t in d.loss_fn_inputs.items()}
        data.append(pb.Datum(model_input=pb.ModelInput(chunks=[chunk]), loss_fn_inputs=inputs))
    if req.loss_fn == "custom":  # the loss itself is filled in by the door (lathe.gateway.custom_losses)
        return pb.ForwardBackwardRequest(model_id=req.model_id, seq_id=req.seq_id, data=data, loss_fn=req.loss_fn,
                                         forward_only=req.forward_only,
                                         custom_loss=pb.CustomLoss(loss_id=_custom_loss_id(req)))
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


def _topk(entries: list[pb.TopkLogprobs]) -> tp.TopkLogprobs:
    """Dense ``[len(entries), k]`` matrices, Tinker's filler where an entry holds fewer than k (or none)."""
    k = max((len(e.token_ids) for e in entries), default=0)
    ids = np.full((len(entries), k), TOPK_EMPTY_ID, dtype="<i4")
    lps = np.full((len(entries), k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, e in enumerate(entries):
        n = len(e.token_ids)
        ids[i, :n], lps[i, :n] = e.token_ids, e.logprobs
    return tp.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(entries))


def _public_tensor(t: pb.Tensor, layout: tp.SparseCsr | None = None) -> tp.Tensor:
    """A dense 2-D tensor as Tinker's, sparse with ``layout``'s cells when the request came sparse."""
    dtype = _PROTO_DTYPES[t.dtype]
    if layout is None:
        return tp.Tensor(dense=t.data, dtype=dtype, shape=t.shape)
    dense = np.frombuffer(t.data, dtype=np.dtype(t.dtype).newbyteorder("<")).reshape(list(t.shape))
    crow = _array(layout.crow_indices, "int64", "layout")
    values = dense[np.repeat(np.arange(len(crow) - 1), np.diff(crow)), _array(layout.col_indices, "int64", "layout")]
    return tp.Tensor(sparse_csr=tp.SparseCsr(values=values.tobytes(), crow_indices=layout.crow_indices,
                                             col_indices=layout.col_indices), dtype=dtype, shape=t.shape)


def sample_response_to_proto(out: pb.SampleOutput, target_layout: tp.SparseCsr | None = None) -> bytes:
    """A sampler result as Tinker's ``SampleResponse`` (the sampler already left out what
    ``prompt_logprobs_last_n`` did not ask for). ``target_layout``: the cells of a sparse
    ``target_prompt_logprobs`` request, which its answer lists in the same layout."""
    msg = tp.SampleResponse(sequences=[
        tp.SampledSequence(stop_reason=_STOP_REASONS[s.stop_reason], tokens=np.asarray(s.tokens, "<i4").tobytes(),
                           logprobs=_f32(s.logprobs),
                           topk_sampled_logprobs=_topk(list(s.topk_logprobs)) if s.topk_logprobs else None)
        for s in out.sequences])
    if out.prompt_logprobs:
        msg.prompt_logprobs = _f32(out.prompt_logprobs)
    if out.topk_prompt_logprobs:
        msg.topk_prompt_logprobs.CopyFrom(_topk(list(out.topk_prompt_logprobs)))
    if out.HasField("target_prompt_logprobs"):
        msg.target_prompt_logprobs.CopyFrom(_public_tensor(out.target_prompt_logprobs, target_layout))
    if out.HasField("prompt_alt_tokens"):
        msg.prompt_alt_tokens.CopyFrom(tp.PromptAltTokens(tokens=_public_tensor(out.prompt_alt_tokens.tokens),
                                                          logprobs=_public_tensor(out.prompt_alt_tokens.logprobs)))
    return msg.SerializeToString()
