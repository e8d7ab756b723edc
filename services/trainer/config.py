"""The trainer pool's configuration: one frozen dataclass, checked when made (``--dtype auto`` resolved to the
dtype the pool's device chose)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lathe.models.pool import PoolOptions
from lathe.trainer.custom_loss import LossBudget
from lathe.trainer.recovery import SnapshotPolicy


@dataclass(frozen=True, slots=True)
class TrainerConfig(PoolOptions):
    """The trainer pool's configuration; ``python -m lathe.trainer`` has a flag for each field (``--cycle-tokens``
    for ``cycle_tokens``), its help the field's docstring (``lathe.runtime.options``)."""

    activation_checkpointing: bool = False
    """recompute each layer in backward (about half the peak memory, about 20% slower)"""
    max_request_tokens: int = 65536
    """tokens of one forward_backward or forward request at most"""
    cycle_tokens: int = 2048
    """token capacity of one clock cycle (CPU default; GPU pools set far more)"""
    max_queue: int = 4096
    """operations waiting, all tenants together"""
    max_queue_per_tenant: int = 1024
    """operations waiting, one tenant's runs together"""
    max_resident_adapters: int = 256
    """adapters held in memory; more are paged out to page_store"""
    cycle_gather_s: float = 0.01
    """how long a cycle may wait for the optim_step following a forward_backward (or the rejoin window, when
    longer: a burst of clients spreads its requests over the gateway)"""
    rejoin_fraction: float = 0.05
    """a cycle waits this share of the last one for that one's runs, renewed as each comes back"""
    rejoin_max_s: float = 0.1
    """and never a window longer than this (0: no wait)"""
    rejoin_write_max_s: float = 2.0
    """but for a run whose answer waits on its snapshot write, up to this long after the cycle"""
    max_runs_per_cycle: int = 0
    """0: every ready run shares the cycle; 1: one run at a time (the baseline)"""
    page_store: str = ""
    """directory for paged-out adapters ("": <cache_root>/paged)"""
    order_wait_s: float = 300.0
    """operations that wait this long for a seq_id that never arrives fail, naming it"""
    snapshots: SnapshotPolicy = field(default_factory=SnapshotPolicy, metadata={
        "flags": {"every_steps": "--snapshot-every", "stagger": "--snapshot-stagger"}})
    """recovery snapshots (``lathe.trainer.recovery``)"""
    loss_budget: LossBudget = field(default_factory=LossBudget, metadata={
        "flags": {"elements": "--max-loss-elements", "calls": "--max-loss-calls"}})
    """custom losses' budgets (``lathe.trainer.custom_loss``)"""

    def __post_init__(self) -> None:
        PoolOptions.__post_init__(self)  # (a slots dataclass has no zero-argument super())
        if not self.order_wait_s > 0:
            raise ValueError(f"order_wait_s must be > 0 seconds, got {self.order_wait_s}")
        if not self.cycle_gather_s >= 0:
            raise ValueError(f"cycle_gather_s must be >= 0 seconds, got {self.cycle_gather_s}")
        if not (self.rejoin_fraction >= 0 and self.rejoin_max_s >= 0 and self.rejoin_write_max_s >= 0):
            raise ValueError(f"rejoin_fraction, rejoin_max_s and rejoin_write_max_s must be >= 0, got "
                             f"{self.rejoin_fraction}, {self.rejoin_max_s} and {self.rejoin_write_max_s}")
