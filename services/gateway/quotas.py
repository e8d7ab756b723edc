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
    max_inflight_ops         gateway, every request that gets a future (create model, ordered ops, samples):
                             the tenant's results not finished yet (``FutureStore`` counts them)
    max_tokens_per_minute    gateway: a sliding window over the last 60 s of the tokens of forward /
                             forward_backward datums (charged when submitted), sample prompts (when submitted)
                             and sampled tokens (when the sample finishes: generation is paid after the fact,
                             so one sample may overshoot, and the tenant's next request waits it off)
    max_user_metadata_bytes  gateway: the UTF-8 bytes of keys and values of one user_metadata (a session's, a
                             run's, a save's)
    max_resident_adapters    trainer (sent with ``CreateAdapterRequest``): beyond it the tenant's own least
                             recently used adapters are paged out; the pool's capacity still binds for all
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

from lathe.errors import ResourceExhausted
from lathe.v1 import lathe_pb2 as pb

WINDOW_S = 60.0  # the tokens-per-minute window
INFLIGHT_RETRY_S = 1.0  # when to come back with too many requests in flight (results usually take about that)


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    max_runs: int = 256
    max_inflight_ops: int = 4096  # all pools together; the trainer's own share (1024 queued) binds there first
    max_tokens_per_minute: int = 16 << 20
    max_checkpoint_bytes: int = 64 << 30
    max_user_metadata_bytes: int = 16 << 10
    max_resident_adapters: int = 64  # of the trainer pool's capacity (256 by default) for all tenants

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
class _Window:
    """Tokens charged in the last ``WINDOW_S`` seconds, as (when, tokens) events, oldest first."""

    events: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.total -= self.events.popleft()[1]

    def wait_for(self, tokens: int, now: float) -> float:
        """Seconds until the oldest events holding ``tokens`` tokens have left the window."""
        freed = 0
        for when, n in self.events:
            freed += n
            if freed >= tokens:
                return max(0.0, when + WINDOW_S - now)
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

    def admit_run(self, tenant: str, runs: int, in_flight: int, user_metadata: Mapping[str, str]) -> None:
        """A new training run, the tenant having ``runs`` already and ``in_flight`` unfinished requests."""
        q = self.of(tenant)
        if runs >= q.max_runs:
            raise ResourceExhausted(f"quota max_runs: tenant has {runs} training runs, the limit is {q.max_runs}")
        self._check_in_flight(q, in_flight)
        self.check_metadata(tenant, user_metadata)

    def admit_op(self, tenant: str, in_flight: int, op: Mapping[str, object]) -> None:
        """One ordered operation (``forward_backward`` / ``optim_step`` / ``save`` / ``load`` -> its request)."""
        q = self.of(tenant)
        self._check_in_flight(q, in_flight)
        save = op.get("save")
        if isinstance(save, pb.SaveRequest):
            self.check_metadata(tenant, save.user_metadata)
        fb = op.get("forward_backward")
        self._spend(tenant, q, datum_tokens(fb.data) if isinstance(fb, pb.ForwardBackwardRequest) else 0)

    def admit_sample(self, tenant: str, in_flight: int, req: pb.SampleRequest) -> None:
        """A sample request: its prompt is charged now, its sampled tokens by ``charge`` once they exist."""
        q = self.of(tenant)
        self._check_in_flight(q, in_flight)
        self._spend(tenant, q, len(req.prompt))

    def check_metadata(self, tenant: str, user_metadata: Mapping[str, str]) -> None:
        limit = self.of(tenant).max_user_metadata_bytes
        size = metadata_bytes(user_metadata)
        if size > limit:
            raise ResourceExhausted(f"quota max_user_metadata_bytes: user_metadata has {size} bytes "
                                    f"({len(user_metadata)} entries), the limit is {limit}")

    def charge(self, tenant: str, tokens: int) -> None:
        """Record ``tokens`` already spent (sampled tokens); never refuses."""
        if tokens > 0:
            now = self.clock()
            w = self._windows.setdefault(tenant, _Window())
            w.expire(now)
            w.events.append((now, tokens))
            w.total += tokens

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

    def _spend(self, tenant: str, q: TenantQuotas, tokens: int) -> None:
        """Charge ``tokens`` now, or refuse if the window would then hold more than the limit."""
        if tokens <= 0:
            return
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
        self.charge(tenant, tokens)
