"""What the gateway looks up about the world it routes to: the models its pools serve, and one checkpoint.

``Lookups`` owns the capabilities cache (the models of the pools present, each with its trainer's and sampler's
exactness, kept while every model is checked and no pool came or went: ``routing.PoolRouter``) and the LoRA cost
each trainer last reported (what the adapter-bytes quota reads); it answers a checkpoint's stat from the
checkpoints service. ``runs``, ``sampling`` and the doors read it; it holds nothing of a tenant's.
"""

from __future__ import annotations

import math
import time

from lathe.errors import InvalidArgument
from lathe.v1 import checkpoints_pb2 as cpb
from lathe.v1 import checkpoints_pb2_grpc as cpb_grpc
from lathe.v1 import lathe_pb2 as pb

from .calls import Caller
from .limits import RequestLimits
from .routing import PoolRouter

CAPABILITIES_TTL_S = 30.0


class Lookups:
    def __init__(self, router: PoolRouter, limits: RequestLimits, caller: Caller,
                 checkpoints: cpb_grpc.CheckpointsStub) -> None:
        self.router, self.limits, self.caller, self.checkpoints = router, limits, caller, checkpoints
        self._caps: tuple[float, int, pb.ServerCapabilities] | None = None  # (when, router generation, caps)
        self.lora_costs: dict[str, pb.LoraCost] = {}  # base model -> its trainer's LoRA cost, as last reported

    async def capabilities(self) -> pb.ServerCapabilities:
        """The models of the pools present, each with its trainer's and sampler's exactness joined, and the doors'
        limits with the sampler pools' token budget."""
        now, generation = time.monotonic(), self.router.generation
        if self._caps is None or now - self._caps[0] > CAPABILITIES_TTL_S or self._caps[1] != generation:
            caps = await self.router.capabilities()
            sample_budget = caps.limits.max_sample_tokens  # the sampler pools' budget
            caps.limits.CopyFrom(self.limits.proto())
            caps.limits.max_sample_tokens = sample_budget
            settled = all(m.trainer_exactness.checked and m.sampler_exactness.checked for m in caps.supported_models)
            self._caps = (now if settled else -math.inf, generation, caps)
            self.lora_costs |= {m.model_name: m.lora_cost for m in caps.supported_models if m.HasField("lora_cost")}
        return self._caps[2]

    async def context_length(self, base_model: str) -> int:
        """The context length of ``base_model`` as the capabilities say; 0 while no pool serves it."""
        caps = await self.capabilities()
        return next((m.max_context_length for m in caps.supported_models if m.model_name == base_model), 0)

    async def check_base_model(self, base_model: str) -> int:
        """``base_model``'s context length; InvalidArgument naming the served models when no pool serves it."""
        context = await self.context_length(base_model)
        if not context:
            names = [m.model_name for m in (await self.capabilities()).supported_models]
            raise InvalidArgument(f"unknown base_model {base_model!r}; this server serves {names}")
        return context

    async def checkpoint(self, tenant: str, path: str) -> cpb.CheckpointInfo:
        """The caller's checkpoint at ``path`` (the checkpoints service refuses anyone else's)."""
        return await self.caller.send(self.checkpoints.Stat, cpb.CheckpointRef(tenant=tenant, path=path))
