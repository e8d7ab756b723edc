"""The trainer pool's configuration: one frozen dataclass, checked when made (``--dtype auto`` resolved to the
dtype the pool's device chose)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lathe.models.pool import check_device, default_device, resolve_dtype
from lathe.trainer.custom_loss import LossBudget
from lathe.trainer.recovery import SnapshotPolicy


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    models: str = "lathe/tiny-llama"  # catalog spec: comma-separated served names or model dirs
    cache_root: Path = Path(".cache/lathe")
    # of the frozen base weights ("auto": bf16 where the device has it natively); LoRA weights, gradients and AdamW
    # moments stay fp32
    dtype: str = "float32"
    device: str = field(default_factory=default_device)  # "cuda" or "cpu": base models and the adapter bank
    invariant: bool = True
    sgmv: bool = False  # LoRA through the Triton SGMV kernels (GPU pools; set alike on the sampler pool)
    activation_checkpointing: bool = False  # recompute each layer in backward: ~half the memory, ~20% slower
    max_request_tokens: int = 65536
    cycle_tokens: int = 2048  # token capacity of one clock cycle (CPU default; GPU pools set far more)
    max_queue: int = 4096  # operations waiting, all tenants together
    max_queue_per_tenant: int = 1024  # operations waiting, one tenant's runs together
    max_resident_adapters: int = 256
    cycle_gather_s: float = 0.01  # how long a cycle may wait for an optim_step following a forward_backward
    # (or the rejoin window below, when longer: a burst of clients spreads its requests over the gateway)
    rejoin_fraction: float = 0.05  # a cycle waits this share of the last one for that one's runs to rejoin,
    rejoin_max_s: float = 0.1  # never longer than this (0: no wait), renewed as each of them comes back
    rejoin_write_max_s: float = 2.0  # and while one's answer waits for its snapshot write, up to this long
    max_runs_per_cycle: int = 0  # 0: every ready run shares the cycle; 1: one tenant at a time (baseline)
    page_store: str = ""  # where paged-out adapters go ("": <cache_root>/paged)
    order_wait_s: float = 300.0  # operations waiting this long for a seq_id that has not arrived fail
    snapshots: SnapshotPolicy = field(default_factory=SnapshotPolicy)  # recovery snapshots (lathe.trainer.recovery)
    loss_budget: LossBudget = field(default_factory=LossBudget)  # custom losses (lathe.trainer.custom_loss)

    def __post_init__(self) -> None:
        check_device(self.device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))  # "auto" becomes what it chose
        if not self.order_wait_s > 0:
            raise ValueError(f"order_wait_s must be > 0 seconds, got {self.order_wait_s}")
        if not self.cycle_gather_s >= 0:
            raise ValueError(f"cycle_gather_s must be >= 0 seconds, got {self.cycle_gather_s}")
        if not (self.rejoin_fraction >= 0 and self.rejoin_max_s >= 0 and self.rejoin_write_max_s >= 0):
            raise ValueError(f"rejoin_fraction, rejoin_max_s and rejoin_write_max_s must be >= 0, got "
                             f"{self.rejoin_fraction}, {self.rejoin_max_s} and {self.rejoin_write_max_s}")
