"""``SamplingClient``: sampling from one policy version, shaped like Tinker's.

A sampling client is bound, when it is created, to one sampling session on the gateway: a saved sampler
checkpoint (``tinker://<run>/sampler_weights/<name>``, pinned to the version that existed then, so it never
silently serves a newer adapter) or a base model. Each ``sample`` is a server-side future; every returned
sequence names the policy version that produced it. Requests carry a per-client ``seq_id`` so a retried
submit is answered once; sampling requests need no ordering among themselves. A client made with its own
``retry_config`` (a ``RetryPolicy``) retries its submits by that policy instead of its connection's.

The session's id is the client's sampler handle (``get_sampler_handle``): ``from_sampler_handle`` joins the session
as a new client of it (``Gateway.JoinSamplingSession``, the tenant's own sessions only), numbered by the gateway so
its ``seq_id``s (from ``number * CLIENT_STRIDE + 1``) never meet another client's; such a client owns the connection
it opened. The client also owns its last-seen queue state: the polls of its samples report theirs, and
``on_queue_state_change`` is called (on the connection's loop) each time the client's state changes.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from typing import Any

from lathe import wire
from lathe.connect import open_connection
from lathe.futures import APIFuture, Connection, RetryPolicy, server_future
from lathe.tokenizer import load_tokenizer
from lathe.types import CLIENT_STRIDE, ModelInput, QueueState, SampleResponse, SamplingParams, TensorData
from lathe.v1 import lathe_pb2 as pb

log = logging.getLogger("lathe")


class SamplingClient:
    """Made by ``ServiceClient.create_sampling_client`` or ``TrainingClient.save_weights_and_get_sampling_client``."""

    def __init__(self, conn: Connection, session: pb.SamplingSession, retry: RetryPolicy | None = None,
                 client_counter: int = 0, owns_conn: bool = False) -> None:
        """``client_counter``: this client's number among the session's (0: its creator); ``owns_conn``: ``close``
        closes ``conn`` (one ``from_sampler_handle`` opened), else its ``ServiceClient`` does."""
        self._conn = conn
        self._retry = retry
        self._owns_conn = owns_conn
        self.sampling_session_id = session.sampling_session_id
        self.base_model = session.base_model
        self.model_path = session.model_path or None
        self._seq = itertools.count(client_counter * CLIENT_STRIDE + 1)
        self._lock = threading.Lock()
        self._queue_state = QueueState.ACTIVE  # touched only on the connection's loop

    def __repr__(self) -> str:
        return f"<SamplingClient {self.model_path or self.base_model}>"

    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs: TensorData | None = None, prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[SampleResponse]:
        """``num_samples`` completions of ``prompt``, each with per-token logprobs and its stop reason.

        Options, as Tinker defines them (every logprob at temperature 1, from the rows the tokens are drawn from):
        ``topk_sample_logprobs`` k: the k best (id, logprob) of each sampled token's row
        (``SampledSequence.topk_logprobs``); ``prompt_logprobs_last_n`` n: score only the last n prompt tokens
        (needs ``include_prompt_logprobs``; also applies to ``topk_prompt_logprobs``);
        ``target_prompt_logprobs``: int64 ids ``[len(prompt) - 1, K]``, cell ``[i, j]`` scored at prompt position
        ``i + 1`` and -1 asking for nothing; ``prompt_alt_tokens_k`` k: k draws, with replacement and at the
        request's temperature, at every prompt position after the first (``SampleResponse.prompt_alt_tokens``).
        """
        with self._lock:
            seq = next(self._seq)
        request = pb.SampleRequest(
            sampling_session_id=self.sampling_session_id, seq_id=seq, prompt=prompt.to_ints(),
            params=wire.sampling_params_to_proto(sampling_params), num_samples=num_samples,
            prompt_logprobs=include_prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs, prompt_alt_tokens_k=prompt_alt_tokens_k,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            target_prompt_logprobs=(wire.tensor_to_proto(target_prompt_logprobs)
                                    if target_prompt_logprobs is not None else None))
        return server_future(self._conn, self._submit(request),
                             functools.partial(wire.result_from_proto, kind=SampleResponse), self._see_queue_state)

    async def sample_async(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
                           include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
                           topk_sample_logprobs: int = 0, target_prompt_logprobs: TensorData | None = None,
                           prompt_alt_tokens_k: int = 0, prompt_logprobs_last_n: int | None = None
                           ) -> APIFuture[SampleResponse]:
        return self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs,
                           topk_sample_logprobs, target_prompt_logprobs, prompt_alt_tokens_k, prompt_logprobs_last_n)

    async def _submit(self, request: pb.SampleRequest) -> str:
        return (await self._conn.call("Sample", request, retry=self._retry)).request_id

    def _see_queue_state(self, state: str, reason: str | None) -> None:
        """A poll of one of this client's samples heard ``state``: tell ``on_queue_state_change`` if it is new."""
        seen = QueueState(state)
        if seen is not self._queue_state:
            self._queue_state = seen
            self.on_queue_state_change(seen, reason)

    def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
        """Called (on the connection's loop: do not block) when this client's samples start waiting for a reason
        (``PAUSED_CAPACITY``, ``PAUSED_RATE_LIMIT``) or stop (``ACTIVE``). Override to follow it; by default, as in
        Tinker, a pause is logged as a warning and the end of one is not."""
        if queue_state is not QueueState.ACTIVE:
            log.warning("Sampling is paused for sampler %s (%s). Reason: %s", self.sampling_session_id,
                        queue_state.value, queue_state_reason or "unknown")

    def get_sampler_handle(self) -> str:
        """A string another process of the same tenant passes to ``SamplingClient.from_sampler_handle`` to sample
        from this client's sampler (the sampling session's id; it carries no credentials)."""
        return self.sampling_session_id

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None, base_url: str | None = None
                            ) -> SamplingClient:
        """A new client of the sampler behind ``handle`` (``get_sampler_handle``), on its own connection to
        ``base_url`` with ``api_key`` (each else from the environment, as ``ServiceClient`` finds them); ``close``
        it when done. Another tenant's handle is ``NotFound``."""
        conn = open_connection(base_url, api_key)
        try:
            joined = conn.spawn(conn.call("JoinSamplingSession", pb.JoinSamplingSessionRequest(
                sampling_session_id=handle))).result()
        except BaseException:
            conn.close()
            raise
        return SamplingClient(conn, joined.session, client_counter=joined.client_counter, owns_conn=True)

    def close(self) -> None:
        """Close the connection this client opened (``from_sampler_handle``); a client a ``ServiceClient`` made
        shares that client's connection and leaves it open."""
        if self._owns_conn:
            self._conn.close()

    def get_base_model(self) -> str:
        """The base model this client samples from (known since creation: never waits on the server)."""
        return self.base_model

    async def get_base_model_async(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (a ``transformers`` tokenizer; see ``lathe.tokenizer``)."""
        return load_tokenizer(self.base_model)

    def compute_logprobs(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
                         ) -> APIFuture[list[float | None]]:
        """The policy's logprob of every prompt token given the ones before it (None for the first, and for
        every token before the last ``prompt_logprobs_last_n`` when that is set)."""
        fut = self.sample(prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          prompt_logprobs_last_n=prompt_logprobs_last_n)
        return APIFuture(self._conn.spawn(_prompt_logprobs(fut)))

    async def compute_logprobs_async(self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
                                     ) -> APIFuture[list[float | None]]:
        return self.compute_logprobs(prompt, prompt_logprobs_last_n)


async def _prompt_logprobs(fut: APIFuture[SampleResponse]) -> list[float | None]:
    res = await fut
    return list(res.prompt_logprobs or [])
