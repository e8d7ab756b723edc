"""Routing the gateway's calls to the pool that serves each base model.

``PoolRouter`` owns the gRPC channels to every trainer and sampler the ``discovery.PoolDirectory`` names, and
the map base model -> pool, learned from each pool's ``Capabilities`` (the union of which is what
``get_server_capabilities`` answers). It never decides what a call means; ``core.GatewayCore`` does.

Within a pool, an address is chosen by rendezvous hashing of a key (a run's model id, a sampling session's id),
among the ready endpoints when there are any: a run stays on its trainer while the pool is unchanged, and when
one endpoint goes only its keys move. A routed stub (``trainer`` / ``sampler``) chooses again at every attempt,
so the retries of one call follow a pool that moved. With a single pool every model goes to it, as before
discovery existed (the pool's own answer is then the error for a model it does not serve).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from lathe.channels import CHANNEL_OPTIONS
from lathe.errors import LatheError, Unavailable
from lathe.runtime.internal_auth import internal_aio_channel
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

from .calls import RECONNECT_OPTIONS, Caller
from .discovery import Endpoint, Pool, PoolDirectory

log = logging.getLogger("lathe.gateway")

STUBS = {"trainer": pb_grpc.TrainerStub, "sampler": pb_grpc.SamplerStub}


def join_exactness(caps: pb.ServerCapabilities, sampled: pb.ServerCapabilities) -> None:
    """Copy each model's sampler exactness into the trainer's ``caps``; a model's logprobs are exact when
    both pools checked it, both passed and their fingerprints match (same bits on both sides)."""
    by_name = {m.model_name: m.sampler_exactness for m in sampled.supported_models}
    for m in caps.supported_models:
        if m.model_name in by_name:
            m.sampler_exactness.CopyFrom(by_name[m.model_name])
        t, s = m.trainer_exactness, m.sampler_exactness
        m.logprobs_exact = t.checked and s.checked and t.exact and s.exact and t.fingerprint == s.fingerprint


def pick(endpoints: Sequence[Endpoint], key: str) -> str:
    """The address for ``key``: highest rendezvous score among the ready endpoints (all, when none is ready)."""
    candidates = [e for e in endpoints if e.ready] or list(endpoints)
    return max(candidates, key=lambda e: hashlib.blake2b(f"{e.address}\0{key}".encode(), digest_size=8).digest()
               ).address


class RoutedStub:
    """A stub whose every method resolves its target stub when called: ``routed.Run(request, timeout=...)``."""

    def __init__(self, resolve: Callable[[], Awaitable[Any]]) -> None:
        self._resolve = resolve

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, timeout: float | None = None) -> Any:
            stub = await self._resolve()
            return await getattr(stub, method)(request, timeout=timeout)

        return call


class PoolRouter:
    def __init__(self, directory: PoolDirectory, caller: Caller) -> None:
        self.directory = directory
        self.caller = caller
        self.generation = 0  # bumped by the directory's thread at each change; read by the capability cache
        self._seen = -1  # the generation the channels were last reconciled with
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, str], Any] = {}
        self._models: dict[str, str] = {}  # base model -> pool name, from the last capabilities
        self._refresh = asyncio.Lock()
        directory.subscribe(self._changed)

    def _changed(self) -> None:
        self.generation += 1  # only the directory's one thread writes it

    def trainer(self, base_model: str, key: str) -> RoutedStub:
        """The trainer stub of ``base_model``'s pool, for the run ``key``."""
        return RoutedStub(lambda: self._stub("trainer", base_model, key))

    def sampler(self, base_model: str, key: str) -> RoutedStub:
        """A sampler stub of ``base_model``'s pool, for the sampling session ``key``."""
        return RoutedStub(lambda: self._stub("sampler", base_model, key))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()

    async def capabilities(self) -> pb.ServerCapabilities:
        """Every answering pool's models with their exactness joined (a model two pools serve: the first pool by
        name), and ``limits.max_sample_tokens``, the least of the sampler pools' budgets. A pool that fails to
        answer is left out; when every pool fails, its error is raised."""
        await self._reconcile()
        pools = [p for p in self._usable().values() if p.answering]
        answers = await asyncio.gather(*(self._pool_capabilities(p) for p in pools), return_exceptions=True)
        merged, models, budgets, failed = pb.ServerCapabilities(), {}, [], []
        for pool, answer in zip(pools, answers, strict=True):
            if isinstance(answer, LatheError):
                failed.append(answer)
                log.warning("pool %r did not answer Capabilities: %s", pool.name, answer.message)
                continue
            if isinstance(answer, BaseException):
                raise answer
            for m in answer.supported_models:
                if m.model_name not in models:
                    models[m.model_name] = pool.name
                    merged.supported_models.append(m)
            budgets.append(answer.limits.max_sample_tokens)
        if failed and not budgets:
            raise failed[0]
        merged.limits.max_sample_tokens = min(budgets, default=0)
        self._models = models
        return merged

    async def _pool_capabilities(self, pool: Pool) -> pb.ServerCapabilities:
        """One pool's trainer capabilities with its samplers' exactness joined (``limits.max_sample_tokens``: the
        samplers' budget)."""
        request, quick = pb.TrainerCapabilitiesRequest(), self.caller.policy.quick_s
        trainer = self._stub_at("trainer", pick(pool.trainers, ""))
        sampler = self._stub_at("sampler", pick(pool.samplers, ""))
        caps, sampled = await asyncio.gather(
            self.caller.call(trainer.Capabilities, request, deadline_s=quick, idempotent=True),
            self.caller.call(sampler.Capabilities, request, deadline_s=quick, idempotent=True))
        join_exactness(caps, sampled)
        caps.limits.max_sample_tokens = sampled.limits.max_sample_tokens
        return caps

    # ---- resolution ----

    def _usable(self) -> Mapping[str, Pool]:
        """The complete pools now."""
        return {name: p for name, p in self.directory.pools().items() if p.complete}

    async def _reconcile(self) -> None:
        """After the directory changed: close the channels to endpoints that left every pool."""
        if self._seen == self.generation:
            return
        self._seen = self.generation
        present = {e.address for p in self.directory.pools().values() for e in (*p.trainers, *p.samplers)}
        for address in [a for a in self._channels if a not in present]:
            for role in STUBS:
                self._stubs.pop((role, address), None)
            await self._channels.pop(address).close()

    def _known(self, base_model: str, pools: Mapping[str, Pool]) -> str | None:
        """The pool of ``base_model`` by the last capabilities; before any, the only pool if there is one."""
        name = self._models.get(base_model)
        if name in pools:
            return name
        return next(iter(pools)) if len(pools) == 1 and not self._models else None

    async def _pool_for(self, base_model: str) -> Pool:
        pools = self._usable()
        name = self._known(base_model, pools)
        if name is None:
            async with self._refresh:  # one refresh at a time; the others find its map
                pools = self._usable()
                name = self._known(base_model, pools)
                if name is None:
                    await self.capabilities()
                    pools, name = self._usable(), self._models.get(base_model)
        if name not in pools:
            raise Unavailable(f"no pool serves base_model {base_model!r} now (pools: {sorted(pools)}); "
                              "try again once its trainer and sampler are back")
        return pools[name]

    async def _stub(self, role: str, base_model: str, key: str) -> Any:
        await self._reconcile()
        pool = await self._pool_for(base_model)
        return self._stub_at(role, pick(pool.trainers if role == "trainer" else pool.samplers, key))

    def _stub_at(self, role: str, address: str) -> Any:
        stub = self._stubs.get((role, address))
        if stub is None:
            if address not in self._channels:  # sends the stack's secret
                self._channels[address] = internal_aio_channel(address, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])
            stub = self._stubs[(role, address)] = STUBS[role](self._channels[address])
        return stub
