"""The trainer's operations and results as plain Python values: what the engine queues, plans and answers.

An ``Op`` is one ordered operation of one training run (``model_id``, ``seq_id``) with a body, decoded and
checked once at the door (``lathe.trainer.intake.decode_op``) before it reaches the engine:

    ForwardBackward(examples, loss_fn, loss_cfg, backward, custom)  checked datums, the loss and its full config
                                                             (custom: the checked graph of loss_fn "custom")
    OptimStep(params)                                        checked AdamW or Dimuon hyperparameters
    Save(kind, name, ttl_seconds, overwrite, user_metadata, max_checkpoint_bytes)
    Load(path, with_optimizer)
    Skip(error)                                              refused before it was queued: by the gateway's
                                                             door, or by the trainer's own checks

A ``Result`` holds an output (the ``lathe.types`` result values the SDK reads) or a ``LatheError``, and,
once the operation ran, its ``Receipt`` and the recovery snapshot written right after it. Nothing here knows
protobuf; ``intake`` converts at the door.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.errors import LatheError
from lathe.trainer.custom_loss import CustomLoss, LossBudget
from lathe.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    OptimParams,
    OptimStepResponse,
    Receipt,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

SAVE_KINDS = ("weights", "sampler_weights")  # a training state (adapter + optimizer) | a PEFT adapter


@dataclass(frozen=True, slots=True)
class Limits:
    """What a forward_backward on a run must fit: its base model's vocabulary and context, the pool's
    request size and custom-loss budgets."""

    vocab_size: int
    max_context: int
    max_request_tokens: int
    loss_budget: LossBudget = LossBudget()


@dataclass(slots=True)
class Example:
    """One checked datum: model input, targets and float inputs of the loss, all of length L."""

    tokens: list[int]
    targets: torch.Tensor  # [L] int64
    inputs: dict[str, torch.Tensor]  # name -> [L] float32

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ForwardBackward:
    examples: list[Example]
    loss_fn: str
    loss_cfg: dict[str, float]  # the loss's defaults, overridden by the request's loss_fn_config
    backward: bool  # False: a forward only (no gradients)
    custom: CustomLoss | None = None  # loss_fn "custom": what runs per datum

    @property
    def tokens(self) -> int:
        return sum(len(x) for x in self.examples)


@dataclass(slots=True)
class OptimStep:
    params: OptimParams  # checked (``AdamParams.check`` / ``DimuonParams.check``)


@dataclass(slots=True)
class Save:
    kind: str  # one of SAVE_KINDS
    name: str
    ttl_seconds: int  # 0: kept until deleted
    overwrite: bool
    user_metadata: dict[str, str]
    max_checkpoint_bytes: int  # the tenant's checkpoint byte quota, passed on to the checkpoints service; 0: none


@dataclass(slots=True)
class Load:
    path: str  # tinker://<run>/weights/<name>
    with_optimizer: bool


@dataclass(slots=True)
class Skip:
    """A seq_id refused before it was queued (a client error a retry would meet again): answered with ``error``
    at once and passed over in order (``Sequencer.skip``); nothing of it is ever applied."""

    error: LatheError


Body = ForwardBackward | OptimStep | Save | Load | Skip
KINDS: dict[type, str] = {ForwardBackward: "forward_backward", OptimStep: "optim_step", Save: "save", Load: "load",
                          Skip: "skip"}  # the operation's name in receipts (the TrainerOp field it came in)


@dataclass(slots=True)
class Op:
    """One ordered operation of one training run."""

    model_id: str
    seq_id: int
    request_id: str
    tenant: str
    body: Body

    @property
    def kind(self) -> str:
        """The operation's name as receipts and snapshot policies say it: forward_backward, optim_step, ..."""
        return KINDS[type(self.body)]


Output = ForwardBackwardOutput | OptimStepResponse | SaveWeightsResponse | SaveWeightsForSamplerResponse | \
    LoadWeightsResponse


@dataclass(slots=True)
class Result:
    """One operation's answer: ``output`` or ``error``; ``receipt`` once it reached a cycle (a skip has none)."""

    output: Output | None = None
    error: LatheError | None = None
    receipt: Receipt | None = None
    recovery_path: str = ""  # the run's recovery snapshot, written right after this operation ("": none)
