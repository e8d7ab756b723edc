"""lathe.trainer: the training pool, one process holding base models and every run's adapter.

What comes in: ``lathe.v1.Trainer`` calls from the gateway (``server.py``). ``Run(TrainerOp)`` goes through the
intake (``intake.py``) on a worker thread, outside the engine's lock: the request is decoded into a plain
``ops.Op`` and checked once, against its run's base model (``validate.py``: datums, loss and its config;
AdamW hyperparameters; the save kind), so a bad request is refused alone before it is queued (a ``Skip``
carrying its error, answered at once, its seq_id passed over in order).

What the engine owns (``engine.py``, no protobuf in its data path): the base models, the adapter bank
(``bank.py``: LoRA weights, AdamW moments, step; paged to local scratch by ``pages.py``), the runs (``runs.py``:
each run's sequencer, ``order.py``: strict ``seq_id`` order, exactly once; their creation, admission and recovery
snapshots), the cycle thread (``cycle_thread.py``: its loop and heartbeat), when a cycle starts (``window.py``),
the cycle planner (``cycle.py``), one cycle's execution (``runner.py``) and the packed forward/backward
(``step.py``, ``losses.py``), AdamW (``optimizer.py``), recovery snapshots (``recovery.py``; written and their
answers held by ``answers.py``) and the cycle metrics (``metrics.py``).

What goes out: one ``ops.Result`` per operation (an output or an error, a receipt), written back as a
``TrainerResult`` by the intake; checkpoint and snapshot bytes go to the checkpoints service. It never touches
storage directly and imports no SDK client module.
"""
