"""Per-tenant quotas: what one tenant may hold and spend, configured per tenant, and the book that keeps count.

``TenantQuotas`` are one tenant's limits; ``QuotaConfig`` holds the default and per-tenant overrides, read from
the file given with ``--quotas`` (JSON, or TOML when the name ends in ``.toml``)::

    {"default": {"max_runs": 64, "max_tokens_per_minute": 2000000},
     "tenants": {"alice": {"max_runs": 8}, "bob": {"max_resident_adapters": 4}}}

A tenant's entry overrides only the fields it names, on top of ``default``, on top of the built-in defaults.
``Quotas`` is the accounting ``GatewayCore`` calls before it registers anything, so a refused request leaves no
state behind. Each quota binds in one place:

    max_runs                 gateway, creating a run: the training runs the tenant has here (Tinker has no call
                             that deletes one, so this caps the adapters a tenant can make the trainer keep)
    max_adapter_bytes        gateway, creating a run (fresh or from a saved state): what the tenant's runs make
                             the trainer allocate, resident or paged (``adapter_bytes``)
    max_sessions             gateway, creating a session: the tenant's sessions not finished yet
    max_sampling_sessions    gateway, creating a sampling session (and at a save for sampling, which makes one):
                             the sampling session numbers handed out in the tenant's open sessions
    max_inflight_ops         gateway, every request that gets a future (create model, ordered ops, samples):
                             the tenant's results not finished yet (``FutureStore`` counts them)
    max_tokens_per_minute    gateway: a sliding window over the last 60 s of the tokens of forward /
                             forward_backward datums (charged when submitted) and samples: a sample is charged
                             its prompt and the most it may sample (num_samples x max_tokens) when submitted,
                             and given back what it did not sample once it finishes (``settle_sample``)
    max_user_metadata_bytes  gateway: the UTF-8 bytes of keys and values of one user_metadata (a session's, a
                             run's, a save's)
    max_resident_adapters    trainer (sent with ``CreateAdapterRequest``): beyond it the tenant's own least
                             recently used adapters are paged out; the pool's capacity still binds for all
    max_custom_losses        gateway, creating a custom loss (Tinker's HTTP door): the losses the tenant keeps
                             in the database; beyond it its own oldest go first (a loop that traces a loss per
                             step keeps working), never another tenant's
    max_sequence_records     gateway, a sample with ``record_stability_info``: the sampled sequences the tenant keeps
                             recorded (each for a day after its last use); beyond it its own oldest go first
    max_checkpoint_bytes     checkpoints service (sent with every ``TrainerOp`` and on with the save): bytes
                             of the tenant's live checkpoints; deleting or expiry frees them

A refusal is ``ResourceExhausted`` naming the quota, the tenant's use and the limit, with ``retry_after_s``
(also in the message, which the gRPC door carries) where waiting helps: tokens per minute and in-flight.
"""

from __future__ import annotations

import json
import math
import time
import tomllib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from lathe.errors import ResourceExhausted
from lathe.v1 import lathe_pb2 as pb

WINDOW_S = 60.0  # the tokens-per-minute window
INFLIGHT_RETRY_S = 1.0  # when to come back with too many requests in flight (results usually take about that)
VALUE_BYTES = 4  # an adapter's tensors and its optimizer's are fp32
MOMENTS = {"adamw": 2, "dimuon": 1}  # optimizer tensors per trained tensor (``lathe.trainer.optim_state``)


def adapter_bytes(cost: pb.LoraCost | None, lora: pb.LoraConfig, optimizer: str) -> int:
    """What the trainer allocates for a run's adapter: A and B of every trained target in fp32, and the optimizer's
    moments of each (two for AdamW, one for Dimuon). ``cost``: its model's, as its trainer pool reports it in the
    capabilities (``SupportedModel.lora_cost``); 0 for a model no pool present reports."""
    if cost is None:
        return 0
    per_rank = ((cost.attn_values_per_rank if lora.train_attn else 0)
                + (cost.mlp_values_per_rank if lora.train_mlp else 0)
                + (cost.unembed_values_per_rank if lora.train_unembed else 0))
    return lora.rank * per_rank * VALUE_BYTES * (1 + MOMENTS.get(optimizer, MOMENTS["adamw"]))


def lora_of_checkpoint(meta: Mapping[str, Any]) -> pb.LoraConfig:
    """The LoRA config of a saved training state, from its metadata (the trainer writes its PEFT config there)."""
    targets = meta.get("target_modules") or ()
    return pb.LoraConfig(rank=int(meta.get("r") or 0), train_attn="q_proj" in targets,
                         train_mlp="gate_proj" in targets, train_unembed="lm_head" in targets)


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    max_runs: int = 256
    max_adapter_bytes: int = 4 << 30  # 3 rank-256 SmolLM2 runs (1.09 GB each), or 31 of rank 32
    max_sessions: int = 1024
    max_sampling_sessions: int = 65536  # RL makes one per step (save_weights_and_get_sampling_client)
    max_inflight_ops: int = 4096  # all pools together; the trainer's own share (1024 queued) binds there first
    max_tokens_per_minute: int = 16 << 20
    max_checkpoint_bytes: int = 64 << 30
    max_user_metadata_bytes: int = 16 << 10
    max_resident_adapters: int = 64  # of the trainer pool's capacity (256 by default) for all tenants
    max_custom_losses: int = 1024
    max_sequence_records: int = 65536  # about 0.5 GB of database at 1k sampled tokens a record
    max_inflated_bytes: int = 16 << 20  # a zstd body decompressed, at most; the gateway's flag caps it

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if type(value) is not int or value < 1:
                raise ValueError(f"quota {name} must be an integer >= 1, got {value!r}")

    def updated(self, overrides: Mapping[str, object], source: str) -> TenantQuotas:
        """These quotas with ``overrides`` (field name -> value) applied; unknown names are refused."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"{source}: unknown quota {unknown[0]!r}; known: {[f.name for f in fields(self)]}")
        try:
            return replace(self, **overrides)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    default: TenantQuotas = field(default_factory=TenantQuotas)
    tenants: Mapping[str, TenantQuotas] = field(default_factory=dict)

    def of(self, tenant: str) -> TenantQuotas:
        return self.tenants.get(tenant, self.default)

    @classmethod
    def parse(cls, doc: object, source: str = "quotas") -> QuotaConfig:
        """From ``{"default": {...}, "tenants": {"<tenant>": {...}}}`` (both keys optional)."""
        if not isinstance(doc, dict) or set(doc) - {"default", "tenants"}:
            raise ValueError(f"{source}: expected an object with the keys 'default' and 'tenants', got "
                             f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
        default = TenantQuotas().updated(_table(doc.get("default", {}), f"{source}: default"), f"{source}: default")
        tenants = {}
        for name, over in _table(doc.get("tenants", {}), f"{source}: tenants").items():
            where = f"{source}: tenants.{name}"
            tenants[name] = default.updated(_table(over, where), where)
        return cls(default, tenants)

    @classmethod
    def from_file(cls, path: Path | str | None) -> QuotaConfig:
        """The quotas in the file at ``path`` (TOML if it ends in ``.toml``, else JSON); none: the defaults."""
        if not path:
            return cls()
        text = Path(path).read_text()
        try:
            doc = tomllib.loads(text) if str(path).endswith(".toml") else json.loads(text)
        except ValueError as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
            raise ValueError(f"quotas file {path}: {e}") from None
        return cls.parse(doc, f"quotas file {path}")


def _table(value: object, source: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be an object, got {type(value).__name__}")
    return value


def datum_tokens(data: Iterable[pb.Datum]) -> int:
    """The model-input tokens of ``data`` (what a forward / forward_backward computes over)."""
    return sum(len(chunk.tokens) for d in data for chunk in d.model_input.chunks)


def metadata_bytes(metadata: Mapping[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())


@dataclass(slots=True)
class Charge:
    """Tokens charged at ``when``; ``held``: how many of them a sample holds for what it may still sample."""

    when: float
    tokens: int
    held: int = 0


@dataclass(slots=True)
class _Window:
    """Tokens charged in the last ``WINDOW_S`` seconds, oldest first."""

    events: deque[Charge] = field(default_factory=deque)
    total: int = 0

    def expire(self, now: float) -> None:
        while self.events and self.events[0].when <= now - WINDOW_S:
            self.total -= self.events.popleft().tokens

    def wait_for(self, tokens: int, now: float) -> float:
        """Seconds until the oldest events holding ``tokens`` tokens have left the window."""
        freed = 0
        for c in self.events:
            freed += c.tokens
            if freed >= tokens:
                return max(0.0, c.when + WINDOW_S - now)
        return WINDOW_S


class Quotas:
    """The gateway's quota book: limits per tenant and each tenant's token window.

    Counts the core already keeps (its runs, the futures in flight) are passed in rather than kept twice;
    the token windows are this book's own. ``clock`` gives monotonic seconds (injectable for tests).
    """

    def __init__(self, config: QuotaConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or QuotaConfig()
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    def of(self, tenant: str) -> TenantQuotas:
        return self.config.of(tenant)

    # ---- admission: each checks everything first, then charges ----

    def admit_run(self, tenant: str, held: list[int], run_bytes: int, in_flight: int,
                  user_metadata: Mapping[str, str]) -> None:
        """A new training run of ``run_bytes`` adapter bytes (``adapter_bytes``), the tenant's runs already holding
        ``held`` bytes each, with ``in_flight`` unfinished requests."""
        q = self.of(tenant)
        if len(held) >= q.max_runs:
            raise ResourceExhausted(f"quota max_runs: tenant has {len(held)} training runs, the limit is {q.max_runs}")
        if sum(held) + run_bytes > q.max_adapter_bytes:
            raise ResourceExhausted(f"quota max_adapter_bytes: tenant's {len(held)} training runs hold {sum(held)} "
                                    f"adapter bytes and the new one needs {run_bytes} (weights and optimizer moments "
                                    f"in fp32), the limit is {q.max_adapter_bytes}")
        self._check_in_flight(q, in_flight)
        self.check_metadata(tenant, user_metadata)

    def admit_session(self, tenant: str, open_sessions: int, user_metadata: Mapping[str, str]) -> None:
        """A new session, the tenant having ``open_sessions`` not finished yet."""
        limit = self.of(tenant).max_sessions
        if open_sessions >= limit:
            raise ResourceExhausted(f"quota max_sessions: tenant has {open_sessions} open sessions, the limit is "
                                    f"{limit}; finish the sessions it no longer uses")
        self.check_metadata(tenant, user_metadata)

    def admit_sampling_session(self, tenant: str, sampling_sessions: int) -> None:
        """A new sampling session, the tenant having ``sampling_sessions`` in its open sessions."""
        limit = self.of(tenant).max_sampling_sessions
        if sampling_sessions >= limit:
            raise ResourceExhausted(f"quota max_sampling_sessions: tenant has {sampling_sessions} sampling sessions "
                                    f"in its open sessions, the limit is {limit}; finish the sessions it no longer "
                                    "uses")

    def admit_op(self, tenant: str, in_flight: int, op: Mapping[str, object]) -> None:
        """One ordered operation (``forward_backward`` / ``optim_step`` / ``save`` / ``load`` -> its request)."""
        q = self.of(tenant)
        self._check_in_flight(q, in_flight)
        save = op.get("save")
        if isinstance(save, pb.SaveRequest):
            self.check_metadata(tenant, save.user_metadata)
        fb = op.get("forward_backward")
        self._spend(tenant, q, datum_tokens(fb.data) if isinstance(fb, pb.ForwardBackwardRequest) else 0)

    def admit_sample(self, tenant: str, in_flight: int, req: pb.SampleRequest, context_length: int
                     ) -> Charge | None:
        """A sample request: its prompt and the most it may sample are charged now: ``num_samples`` x
        ``max_tokens``, or without max_tokens x what the model's ``context_length`` leaves after the prompt (what
        the sampler allows). Returns the charge, which ``settle_sample`` settles once the tokens are known."""
        q = self.of(tenant)
        self._check_in_flight(q, in_flight)
        per_sample = req.params.max_tokens if req.params.HasField("max_tokens") else context_length - len(req.prompt)
        most = req.num_samples * max(0, per_sample)
        charge = self._spend(tenant, q, len(req.prompt) + most)
        if charge is not None:
            charge.held = most
        return charge

    def settle_sample(self, tenant: str, charge: Charge | None, sampled: int) -> None:
        """A sample finished (or failed: 0) with ``sampled`` tokens: what its admission's ``charge`` held beyond them
        is given back while the charge is in the window. Without a charge (it was admitted before a restart) the
        tokens are charged now."""
        if charge is None:
            self.charge(tenant, sampled)
            return
        back, charge.held = max(0, charge.held - sampled), 0
        now, w = self.clock(), self._windows[tenant]
        w.expire(now)
        if back and charge.when > now - WINDOW_S:  # not expired: still among the window's events
            charge.tokens -= back
            w.total -= back

    def check_metadata(self, tenant: str, user_metadata: Mapping[str, str]) -> None:
        limit = self.of(tenant).max_user_metadata_bytes
        size = metadata_bytes(user_metadata)
        if size > limit:
            raise ResourceExhausted(f"quota max_user_metadata_bytes: user_metadata has {size} bytes "
                                    f"({len(user_metadata)} entries), the limit is {limit}")

    def charge(self, tenant: str, tokens: int) -> Charge | None:
        """Record ``tokens`` spent (none: None); never refuses."""
        if tokens <= 0:
            return None
        c = Charge(self.clock(), tokens)
        w = self._windows.setdefault(tenant, _Window())
        w.expire(c.when)
        w.events.append(c)
        w.total += tokens
        return c

    def pressure(self, tenant: str, in_flight: int) -> str | None:
        """Which of the tenant's quotas refuses new work now (with ``in_flight`` unfinished requests), in words;
        None while each still has room. Reads, never charges."""
        q = self.of(tenant)
        if in_flight >= q.max_inflight_ops:
            return f"quota max_inflight_ops: {in_flight} requests in flight, the limit is {q.max_inflight_ops}"
        w = self._windows.get(tenant)
        if w is not None:
            w.expire(self.clock())
            if w.total >= q.max_tokens_per_minute:
                return (f"quota max_tokens_per_minute: {w.total} tokens in the last {WINDOW_S:.0f} s, the limit is "
                        f"{q.max_tokens_per_minute}")
        return None

    # ---- helpers ----

    @staticmethod
    def _check_in_flight(q: TenantQuotas, in_flight: int) -> None:
        if in_flight >= q.max_inflight_ops:
            raise ResourceExhausted(f"quota max_inflight_ops: tenant has {in_flight} requests in flight, the limit "
                                    f"is {q.max_inflight_ops}; retry in {INFLIGHT_RETRY_S:.0f} s, once some have "
                                    "finished", retry_after_s=INFLIGHT_RETRY_S)

    def _spend(self, tenant: str, q: TenantQuotas, tokens: int) -> Charge | None:
        """Charge ``tokens`` now, or refuse if the window would then hold more than the limit."""
        if tokens <= 0:
            return None
        limit = q.max_tokens_per_minute
        if tokens > limit:
            raise ResourceExhausted(f"quota max_tokens_per_minute: the request has {tokens} tokens, more than the "
                                    f"limit of {limit} per minute allows at once; split it")
        now = self.clock()
        w = self._windows.get(tenant)
        if w is not None:
            w.expire(now)
            if w.total + tokens > limit:
                wait = math.ceil(w.wait_for(w.total + tokens - limit, now) * 10) / 10
                raise ResourceExhausted(f"quota max_tokens_per_minute: tenant spent {w.total} tokens in the last "
                                        f"{WINDOW_S:.0f} s and the request has {tokens}, the limit is {limit}; "
                                        f"retry in {wait:.1f} s", retry_after_s=wait)
        return self.charge(tenant, tokens)
