"""lathe.trainer: the training pool, one process holding base models and every run's adapter.

What comes in: ``lathe.v1.Trainer`` calls from the gateway (``server.py``). ``Run(TrainerOp)`` goes through the
intake (``intake.py``) on a worker thread, outside the engine's lock: the request is decoded into a plain
``ops.Op`` and checked once, against its run's base model (``validate.py``: datums, loss and its config;
AdamW hyperparameters; the save kind), so a bad request is refused alone before it is queued (a ``Skip``
carrying its error, answered at once, its seq_id passed over in order).

What the engine owns (``engine.py``, no protobuf in its data path): the base models, the adapter bank
(``bank.py``: LoRA weights, AdamW moments, step; paged to local scratch by ``pages.py``), the runs (``runs.py``:
each run's sequencer, ``order.py``: strict ``seq_id`` order, exactly once, each operation one ``order.Request``
from its arrival to its answer; their creation, admission and recovery snapshots), the cycle thread
(``cycle_thread.py``: its loop and heartbeat), when a cycle starts (``window.py``), the cycle planner
(``cycle.py``), one cycle's execution (``runner.py``) and the packed forward/backward (``step.py``,
``losses.py``), AdamW (``optimizer.py``), recovery snapshots (``recovery.py``; written and their answers held by
``answers.py``) and the cycle metrics (``metrics.py``).

What goes out: one ``ops.Result`` per operation (an output or an error, a receipt), written back as a
``TrainerResult`` by the intake; checkpoint and snapshot bytes go to the checkpoints service. It never touches
storage directly and imports no SDK client module.

A forward_backward takes seven forms here: the ``ops.Op`` the intake decodes; the ``order.Request`` that carries it
from its queue to its answer (its future, its arrival, and its progress over the cycles it spans); its run's share
of a cycle, ``cycle.Work`` (pointing at that same request); the ``plan.Step`` a pool's leader sends its followers in
its place; the ``step.Job`` and ``step.JobResult`` of one packed pass; and the ``ops.Result`` it is answered with.
"""
