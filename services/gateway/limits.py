"""What one request may ask for at the gateway's doors, checked before anything is built, queued or sent on.

Both doors share these checks (``GatewayCore`` calls them), so a request too large or out of range is an
``InvalidArgument`` naming the field and the limit on either door, before a list of ``num_samples`` ids, a
densified tensor or a queued operation exists. The gRPC door also caps a message at ``max_message_bytes``
(grpcio refuses larger ones with RESOURCE_EXHAUSTED) and the HTTP door a body (413). The limits are
reported in ``get_server_capabilities``.

``HttpLimits`` bound what decoding one HTTP body may cost the gateway before any of these checks can run: how far
a compressed body may inflate, how many tokens a body may carry before they become Python lists, and how many
large bodies are read and decoded at once (``tinker_io``). They are the HTTP door's own, not reported.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import numpy as np

from lathe.errors import InvalidArgument, ResourceExhausted
from lathe.types import MAX_TTL_S
from lathe.v1 import lathe_pb2 as pb
from lathe.wire import optim_params_from_proto, tensor_from_proto

SMALL_BODY_BYTES = 1 << 20  # an uncompressed body up to this size is decoded without a place in the DecodeGate
DECODE_WAIT_S = 5.0


def _check_positive(limits: RequestLimits | HttpLimits) -> None:
    for name, value in asdict(limits).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for on either door (each field the gateway's flag of the same name)."""

    max_message_bytes: int = 64 << 20
    """bytes of one gRPC message or HTTP body"""
    max_samples: int = 128
    """num_samples of one sample request"""
    max_topk_prompt_logprobs: int = 20
    """width of every per-position top-k: of prompt and sampled tokens, prompt_alt_tokens_k, the distinct ids of
    target_prompt_logprobs"""
    max_stop_sequences: int = 16
    """stop strings or stop token ids of one request"""
    max_stop_chars: int = 256
    """characters of one stop string"""
    max_tensor_elements: int = 16 << 20
    """values of one tensor (as many as a full message holds float32s)"""

    def __post_init__(self) -> None:
        _check_positive(self)

    def proto(self) -> pb.RequestLimits:
        return pb.RequestLimits(**asdict(self))

    def check_sample(self, req: pb.SampleRequest) -> None:
        """Counts and sizes of a sample request (the sampler checks the rest against its model).

        ``max_topk_prompt_logprobs`` bounds every per-position width, as Tinker bounds them alike: the top-k of
        prompt and sampled tokens, the draws of ``prompt_alt_tokens_k`` and the distinct ids of
        ``target_prompt_logprobs`` (whose cells count against ``max_tensor_elements`` too)."""
        if not 1 <= req.num_samples <= self.max_samples:
            raise InvalidArgument(f"num_samples = {req.num_samples} must be in [1, {self.max_samples}]")
        width = self.max_topk_prompt_logprobs
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if not 0 <= getattr(req, name) <= width:
                raise InvalidArgument(f"{name} = {getattr(req, name)} must be in [0, {width}]")
        if req.HasField("target_prompt_logprobs"):
            cells = len(req.target_prompt_logprobs.data) // 8  # int64 ids (the sampler refuses other dtypes)
            if cells > self.max_tensor_elements:
                raise InvalidArgument(f"target_prompt_logprobs has {cells} cells, over the limit of "
                                      f"{self.max_tensor_elements}")
            try:
                ids = tensor_from_proto(req.target_prompt_logprobs).to_numpy()
            except ValueError as e:
                raise InvalidArgument(f"target_prompt_logprobs: {e}") from None
            distinct = len(np.unique(ids[ids >= 0]))
            if distinct > width:
                raise InvalidArgument(f"target_prompt_logprobs names {distinct} distinct token ids, over the limit "
                                      f"of {width}")
        p = req.params
        for name, values in (("stop_strings", p.stop_strings), ("stop_token_ids", p.stop_token_ids)):
            if len(values) > self.max_stop_sequences:
                raise InvalidArgument(f"params.{name} has {len(values)} entries, over the limit of "
                                      f"{self.max_stop_sequences}")
        for j, s in enumerate(p.stop_strings):
            if len(s) > self.max_stop_chars:
                raise InvalidArgument(f"params.stop_strings[{j}] has {len(s)} characters, over the limit of "
                                      f"{self.max_stop_chars}")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What decoding one HTTP body may cost (each field the gateway's flag of the same name)."""

    max_inflated_bytes: int = 16 << 20
    """bytes a Content-Encoding: zstd body may decompress to (its sender pays only for the compressed bytes, so
    this is far below max_message_bytes; the SDK's forward_backward chunks are at most 5 MB before compression)"""
    max_request_tokens: int = 1 << 20
    """values an HTTP body may carry before they become Python lists: a forward_backward body's token ids,
    counted from their byte lengths, and a JSON body's list items and object members, at most one more than its
    commas"""
    max_concurrent_decodes: int = 4
    """compressed bodies and bodies over 1 MiB being read and decoded at once (the DecodeGate)"""

    def __post_init__(self) -> None:
        _check_positive(self)


class DecodeGate:
    """At most ``slots`` large request bodies read and decoded at once; one more waits up to ``wait_s`` for a place,
    then is refused (``ResourceExhausted`` with a retry-after: the SDK comes back)."""

    def __init__(self, slots: int, wait_s: float = DECODE_WAIT_S) -> None:
        self.slots, self.wait_s = slots, wait_s
        self._free = asyncio.Semaphore(slots)

    @contextlib.asynccontextmanager
    async def place(self, needed: bool) -> AsyncIterator[None]:
        """Hold a place while the body is read and decoded (a small one, not ``needed``, takes none)."""
        if not needed:
            yield
            return
        try:
            async with asyncio.timeout(self.wait_s):
                await self._free.acquire()
        except TimeoutError:
            raise ResourceExhausted(f"max_concurrent_decodes = {self.slots}: that many large requests (HTTP bodies "
                                    f"compressed or over {SMALL_BODY_BYTES} bytes, gRPC forward_backward and sample "
                                    f"messages) are being decoded, and this one waited {self.wait_s:.0f} s for a "
                                    "place", retry_after_s=1.0) from None
        try:
            yield
        finally:
            self._free.release()


def check_op(op: dict[str, object]) -> None:
    """The parameters of one ordered operation that need no model to check: the optimizer's and a save's TTL."""
    step = op.get("optim_step")
    if isinstance(step, pb.OptimStepRequest):
        optim_params_from_proto(step).check()
    save = op.get("save")
    if isinstance(save, pb.SaveRequest) and not 0 <= save.ttl_seconds <= MAX_TTL_S:
        raise InvalidArgument(f"ttl_seconds = {save.ttl_seconds} must be in [0, {MAX_TTL_S}] (0: keep forever)")
