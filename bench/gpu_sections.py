"""The sections of ``bench/gpu_check.py`` by name, in the order it runs them; each runs in its own child process
and records into a ``gpu_context.Context``. The environment section is here; the others are grouped by what they
measure:

    env        versions, GPU, CPU model and flags
    tests, sgmv, exactness, cycle, ranks      training side: ``gpu_train_sections``
    sampler, bgmv, decode                     sampling side: ``gpu_sample_sections``

Shapes, the context and the random models and adapters (no download) are ``gpu_context``'s. Nothing here writes
outside ``Context.scratch``.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable

import torch
from gpu_context import Context
from gpu_sample_sections import bgmv, decode, sampler
from gpu_train_sections import cycle, exactness, ranks, sgmv, tests

from lathe.kernels.sgmv_triton import triton_available


def env(ctx: Context) -> None:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torch cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "peft", "google.protobuf", "grpc", "safetensors", "pytest"):
        try:
            versions[mod] = getattr(__import__(mod, fromlist=["__version__"]), "__version__", "?")
        except ImportError as e:
            versions[mod] = f"not importable: {e}"
    ctx.record("versions", versions)
    ctx.record("lathe.v1", ctx.protos)
    gpu: dict[str, object] = {"available": torch.cuda.is_available(), "pool device": ctx.device}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu |= {"name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory GiB": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count(),
                "triton kernels": triton_available()}
    ctx.record("gpu", gpu)
    cpu: dict[str, object] = {"cores": os.cpu_count()}
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        cpu |= {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)
                if k.strip() in ("Model name", "Flags")}
    except (OSError, subprocess.SubprocessError) as e:
        cpu["lscpu"] = f"failed: {e}"
    ctx.record("cpu", cpu)


SECTIONS: dict[str, Callable[[Context], None]] = {
    "env": env, "tests": tests, "sgmv": sgmv, "exactness": exactness, "cycle": cycle, "sampler": sampler,
    "ranks": ranks, "bgmv": bgmv, "decode": decode,
}
