"""Recorded sampled sequences (``record_stability_info``) and the provenance spans of training datums resolved
against them: what StableReinforce trains on.

Owns the rules, not the rows: the records live in the control database (``ControlStore.put_records`` /
``records``, table ``sequence_records``). ``keep`` records each sequence of a finished sample that asked for it,
under the ``sequence_id`` the sample returned (``"<request id>:<index>"``): its prompt, its sampled tokens, each
token's sampling-time logprob (the behaviour policy's, bit for bit what the trainer computes for the same weights)
and the policy that sampled it. A record lives for ``RECORD_TTL_S`` (a day, as Tinker documents) after its last use;
a tenant keeps at most ``TenantQuotas.max_sequence_records``, its own oldest going first.

``resolve`` takes a ``stable_reinforce`` ``/forward_backward`` (other losses read the logprobs their datums carry),
whose datums carry provenance (``Datum.with_provenance``): runs of
``model_input_spans`` tile the model input, runs of ``loss_fn_input_spans`` tile the loss inputs, each run naming a
recorded sequence and a stretch of its prompt or of its sampled tokens. Every named sequence must have a record of
this tenant, every run must lie inside it, and every token must be the recorded one (a renderer or tokenizer that
re-encodes a sampled text differently is caught here, by datum, span and position), and a non-zero advantage may
sit on sampled tokens only (the rule the cookbook states for StableReinforce). Then the datum's ``logprobs`` input
becomes the record's: the sampling-time logprob at each sampled position, 0 at prompt positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from lathe.errors import InvalidArgument
from lathe.types import TensorData
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import tinker_public_pb2 as tp
from lathe.wire import tensor_from_proto, tensor_to_proto

from .records import SequenceRecord
from .store import ControlStore

RECORD_TTL_S = 24 * 3600.0


class StabilityRecords:
    def __init__(self, store: ControlStore, keep: Callable[[str], int]) -> None:
        """``keep(tenant) -> int``: how many records the tenant may hold (its ``max_sequence_records`` quota)."""
        self.store, self._keep = store, keep

    def keep(self, req: pb.SampleRequest, out: pb.SampleOutput, now: float | None = None) -> None:
        """Record each sequence of ``out``, the result of ``req`` (which asked for it: ``req.record``)."""
        now = time.time() if now is None else now
        prompt = np.asarray(req.prompt, dtype=np.int32).tobytes()
        rows = [SequenceRecord(f"{req.request_id}:{i}", prompt, np.asarray(s.tokens, dtype=np.int32).tobytes(),
                               np.asarray(s.logprobs, dtype=np.float32).tobytes(), s.policy_version, now,
                               now + RECORD_TTL_S)
                for i, s in enumerate(out.sequences)]
        self.store.put_records(req.tenant, rows, self._keep(req.tenant))

    def resolve(self, tenant: str, msg: tp.ForwardBackwardRequest, req: pb.ForwardBackwardRequest,
                now: float | None = None) -> None:
        """Check the provenance of ``msg``'s datums against the tenant's records and put the recorded behaviour
        logprobs into ``req``'s (the same datums, converted); datums without spans are left as they are. Renews
        every record it reads."""
        now = time.time() if now is None else now
        named = {run.sequence_id for d in msg.data for spans in (d.model_input_spans, d.loss_fn_input_spans)
                 for run in map(_run, spans)}
        if not named:
            return
        records = self.store.records(tenant, sorted(named), now, now + RECORD_TTL_S)
        for i, (d, datum) in enumerate(zip(msg.data, req.data, strict=True)):
            if not (d.model_input_spans or d.loss_fn_input_spans):
                continue
            where = f"data[{i}]"
            tokens = list(datum.model_input.chunks[0].tokens)
            _check(tokens, d.model_input_spans, records, f"{where}.model_input_spans", f"{where}.model_input")
            targets = tensor_from_proto(datum.loss_fn_inputs["target_tokens"]).to_numpy().astype(np.int64).tolist() \
                if "target_tokens" in datum.loss_fn_inputs else tokens
            behaviour, sampled = _check(targets, d.loss_fn_input_spans, records, f"{where}.loss_fn_input_spans",
                                        f"{where}.loss_fn_inputs['target_tokens']")
            if "advantages" in datum.loss_fn_inputs:
                advantages = tensor_from_proto(datum.loss_fn_inputs["advantages"]).to_numpy()
                off = np.flatnonzero((advantages != 0) & ~sampled)
                if off.size:
                    raise InvalidArgument(f"{where}.loss_fn_inputs['advantages'][{off[0]}] = "
                                          f"{float(advantages[off[0]])} is on a prompt token: stable_reinforce "
                                          "takes non-zero advantages on sampled tokens only")
            datum.loss_fn_inputs["logprobs"].CopyFrom(tensor_to_proto(TensorData.from_numpy(behaviour)))


def _run(span: tp.ProvenanceSpan) -> tp.PromptProvenanceSpan | tp.SampledProvenanceSpan:
    return getattr(span, span.WhichOneof("span"))


def _check(tokens: list[int], spans: list[tp.ProvenanceSpan], records: dict[str, SequenceRecord], where: str,
           field: str) -> tuple[np.ndarray, np.ndarray]:
    """Walk the runs of ``spans`` over ``tokens`` (``field``'s): each inside its record, each token the recorded
    one. Returns the behaviour logprobs of these positions (the record's at sampled ones, 0 elsewhere) and which
    positions are sampled tokens."""
    logprobs = np.zeros(len(tokens), dtype=np.float32)
    sampled = np.zeros(len(tokens), dtype=bool)
    position = 0
    for j, span in enumerate(spans):
        kind, run = span.WhichOneof("span"), _run(span)
        record = records.get(run.sequence_id)
        if record is None:
            raise InvalidArgument(f"{where}[{j}]: sequence_id {run.sequence_id!r} has no record: it was not sampled "
                                  "with record_stability_info, by this account, or it expired (a day after its last "
                                  "use)")
        source = np.frombuffer(record.prompt if kind == "prompt_tokens" else record.tokens, dtype=np.int32)
        if run.offset + run.length > len(source):
            raise InvalidArgument(f"{where}[{j}]: {kind} [{run.offset}, {run.offset + run.length}) of "
                                  f"{run.sequence_id!r} runs past its {len(source)} recorded tokens")
        for k in range(run.length):
            if tokens[position + k] != source[run.offset + k]:
                raise InvalidArgument(
                    f"{field}[{position + k}] = {tokens[position + k]}, but {run.sequence_id!r} recorded "
                    f"{int(source[run.offset + k])} at {kind}[{run.offset + k}] ({where}[{j}]): the datum's tokens "
                    "are not the sampled ones (was the text re-tokenized?)")
        if kind == "sampled_tokens":
            recorded = np.frombuffer(record.logprobs, dtype=np.float32)
            logprobs[position:position + run.length] = recorded[run.offset:run.offset + run.length]
            sampled[position:position + run.length] = True
        position += run.length
    return logprobs, sampled
