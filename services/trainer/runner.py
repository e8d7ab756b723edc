"""Running one planned cycle, the same on every rank of a pool.

``CycleRunner`` owns the execution of a cycle and nothing else: for the ``cycle.Work`` of each run (planned by the
engine on a pool's leader, replayed from its ``plan.Plan`` on a follower) it runs the controls (saves; loads of
bytes fetched before the plan went out: ``fetch``), then one packed pass per base model (``step.run_jobs``, split by
adapter over a pool's ranks: ``shard``), then the due optim_steps. Each operation's result goes to ``finish`` (the
engine's: receipt, recovery snapshot, answer). The engine owns the runs, their queues and when a cycle runs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

from lathe.errors import Internal, LatheError
from lathe.models.decoder import ExpertLoad
from lathe.trainer import shard
from lathe.trainer.bank import AdapterBank
from lathe.trainer.config import TrainerConfig
from lathe.trainer.custom_loss import reduce_metrics
from lathe.trainer.cycle import Work
from lathe.trainer.dist import Group
from lathe.trainer.lifecycle import BaseModels, RunMaker
from lathe.trainer.metrics import CycleMetrics, sampler_kl
from lathe.trainer.ops import Load, OptimStep, Result, Save
from lathe.trainer.optim_state import optim_step
from lathe.trainer.order import Request
from lathe.trainer.step import Job, JobResult, run_jobs
from lathe.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

Finish = Callable[..., None]
"""``finish(run, item, cycle, start, result, tokens=0)``: the engine answers one operation of the cycle."""


class CycleRunner:
    def __init__(self, cfg: TrainerConfig, bank: AdapterBank, bases: BaseModels, maker: RunMaker,
                 metrics: CycleMetrics, group: Group | None, finish: Finish) -> None:
        self.cfg, self.bank, self.bases, self.maker, self.metrics = cfg, bank, bases, maker, metrics
        self.group, self.finish = group, finish
        self.writes = group is None or group.leader  # a pool's followers never write: the leader does

    def run(self, works: list[Work], cycle: int, start: float) -> int:
        """Controls, the packed pass, optim_steps; returns the tokens computed. An exception of a bug is the
        caller's to answer (``TrainerEngine._execute``)."""
        for w in works:
            if w.control is not None:
                self.finish(w.run, w.control, cycle, start, self._control(w))
        tokens = self._compute([w for w in works if w.compute is not None], cycle, start)
        for w in works:
            if w.optim is not None:
                self.finish(w.run, w.optim, cycle, start, self._optim(w.run.model_id, w.optim.op.body))
        return tokens

    def _compute(self, works: list[Work], cycle: int, start: float) -> int:
        """One packed pass per base model over this cycle's forward / forward_backward parts."""
        by_base: dict[str, list[Work]] = {}
        for w in works:
            by_base.setdefault(self.bank.base_model(w.run.model_id), []).append(w)
        tokens = 0
        for base, part in by_base.items():
            jobs = [Job(self.bank.get(w.run.model_id).weights, w.compute.examples[w.part[0]:w.part[1]],
                        w.compute.op.body.loss_fn, w.compute.op.body.loss_cfg, w.compute.op.body.backward,
                        w.compute.op.body.custom)
                    for w in part]
            tokens += sum(len(x) for j in jobs for x in j.examples)
            model = self.bases.get(base)
            self.bases.exactness.check_ranks(base, model, {j.weights.spec.rank for j in jobs})

            # run_jobs never raises: a job that fails, fails alone (its cycle-mates' results are their own)
            load: ExpertLoad = []  # this rank's share of the routing, on a pool of several
            results = run_jobs(model, jobs, load) if self.group is None else \
                shard.run_sharded(self.group, jobs, functools.partial(run_jobs, model, load=load))
            self.metrics.experts.observe(base, load)
            for w, res in zip(part, results, strict=True):
                self._absorb(w, res, cycle, start)
        return tokens

    def _absorb(self, w: Work, res: JobResult, cycle: int, start: float) -> None:
        """Fold one part's result into its request; answer the request when it is done or failed."""
        m, r = w.run, w.compute
        if res.error is None:
            r.logprobs += res.logprobs
            r.loss += res.loss
            r.metric_sums.update({k: r.metric_sums.get(k, 0.0) + v for k, v in res.metric_sums.items()})
            r.done = w.part[1]
            if not w.last_part:
                return
        elif r.grad_backup is not None:
            for n, param in self.bank.get(m.model_id).weights.named_parameters().items():
                param.grad = r.grad_backup[n]
        m.current = None
        kl = sampler_kl(r.examples, r.logprobs) if res.error is None else None
        if kl is not None:
            self.metrics.observe_kl(kl)
        out = self._fb_result(r, res.error, kl)
        self.finish(m, r, cycle, start, out, tokens=r.op.body.tokens)
        if res.error is not None and w.optim is not None:
            self.finish(m, w.optim, cycle, start, self._optim(m.model_id, w.optim.op.body))
            w.optim = None

    @staticmethod
    def _fb_result(r: Request, error: LatheError | None, kl: float | None) -> Result:
        """The request's answer: its logprobs, a custom loss's metrics, ``loss:sum``, and ``sampler_kl:mean`` (the
        KL from the sampler's logprobs it carried to the trainer's, ``metrics.sampler_kl``) when it carried any."""
        if error is not None:
            return Result(error=error)
        outputs = [{"logprobs": TensorData.from_torch(lp)} for lp in r.logprobs]
        metrics = {**reduce_metrics(r.metric_sums, len(r.logprobs)), "loss:sum": r.loss}
        if kl is not None:
            metrics["sampler_kl:mean"] = kl
        return Result(ForwardBackwardOutput("ArrayRecord", outputs, metrics))

    def _optim(self, model_id: str, step: OptimStep) -> Result:
        try:
            adapter = self.bank.get(model_id)
            metrics = optim_step(adapter.weights.named_parameters(), adapter.opt, step.params)
        except LatheError as e:  # params of another optimizer family than the run's
            return Result(error=e)
        except Exception as e:  # noqa: BLE001 - this step fails alone
            return Result(error=Internal(f"optim_step failed: {type(e).__name__}: {e}"))
        return Result(OptimStepResponse(metrics))

    def fetch(self, w: Work) -> None:
        """Read the checkpoint a load of ``w`` applies (before a pool's plan goes out), or the error reading it
        met: every rank then applies the same bytes, or fails the same way."""
        if w.control is None or not isinstance(w.control.op.body, Load):
            return
        op = w.control.op
        try:
            w.fetched = self.maker.store().get(tenant=op.tenant, path=op.body.path)
        except LatheError as e:
            w.fetched = e
        except Exception as e:  # noqa: BLE001 - e.g. a checkpoint the store cannot decode: this operation fails alone
            w.fetched = Internal(f"{op.kind} failed: {type(e).__name__}: {e}")

    def _control(self, w: Work) -> Result:
        op = w.control.op
        try:
            adapter = self.bank.get(w.run.model_id)
            req = op.body
            if isinstance(req, Save) and not self.writes:
                return Result()  # a follower: the leader writes the checkpoint
            if isinstance(req, Save):
                files = adapter.state_files(self.cfg.dtype) if req.kind == "weights" else adapter.sampler_files()
                meta = {"base_model": adapter.base_model, "step": adapter.step, **adapter.peft_config(),
                        "user_metadata": req.user_metadata}
                path = self.maker.store().put(tenant=op.tenant, run_id=adapter.model_id, kind=req.kind, name=req.name,
                                         files=files, metadata_json=json.dumps(meta),
                                         ttl_seconds=req.ttl_seconds, overwrite=req.overwrite,
                                         max_tenant_bytes=req.max_checkpoint_bytes)
                saved = SaveWeightsResponse if req.kind == "weights" else SaveWeightsForSamplerResponse
                return Result(saved(path))
            if isinstance(w.fetched, LatheError):
                raise w.fetched
            adapter.load_files(w.fetched, with_optimizer=req.with_optimizer)
            return Result(LoadWeightsResponse(req.path, adapter.model_id))
        except LatheError as e:
            return Result(error=e)
        except Exception as e:  # noqa: BLE001 - e.g. a checkpoint the store cannot decode: this operation fails alone
            return Result(error=Internal(f"{op.kind} failed: {type(e).__name__}: {e}"))
