"""Checkpoint transfer: save and load MB/s of a SmolLM2-135M rank-32 training state through the services vs the
``minio`` client writing and reading the same bytes directly, against one live SeaweedFS.

    python bench/bench_checkpoints.py [--repeats 5] [--rank 32] [--append]

The state is the trainer's own: ``Adapter.state_files`` (adapter weights, Adam moments, configs) of a SmolLM2-135M
adapter (all targets) whose tensors hold random values. "Service" is ``CheckpointsClient.put`` / ``get``: chunked
gRPC into a ``python -m lathe.checkpoints`` process over ``s3://``, which hashes every file and streams it into
SeaweedFS (multipart above 16 MiB), then commits the manifest; a load asks the service where the files are
(``Locate``), reads them from SeaweedFS's presigned URLs in parallel and verifies each sha256.
"Direct" is ``Minio.put_object`` / ``get_object`` of the same files with the same part size, from this process; a
direct load is timed two ways: streamed in 4 MiB pieces that are dropped (``direct_load``, the ratio's reference),
and read into one ``bytes`` per file, which a load must hand over (``direct_kept``). Each figure is the median of
``--repeats`` rounds; rounds alternate service and direct. Prints MB/s (10^6 bytes) and the service/direct ratios
(target >= 0.8). ``--append`` adds them, the command and the CPU to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from machine import cpu_line

from lathe.checkpoints.client import CheckpointsClient
from lathe.checkpoints.seaweed import LocalS3
from lathe.models.config import ModelConfig
from lathe.models.lora import LoraSpec
from lathe.runtime.serving import READY_MARK
from lathe.trainer.bank import Adapter

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LATHE_CACHE", REPO / ".cache" / "lathe"))
MODEL = "SmolLM2-135M-Instruct"
PART_BYTES = 16 << 20  # S3Config.part_bytes: the direct client uploads in the same parts
READY_TIMEOUT_S = 60.0


def training_state(rank: int) -> dict[str, bytes]:
    """The files the trainer saves for a SmolLM2-135M adapter of ``rank``, with random weights and moments."""
    cfg = ModelConfig.from_dir(CACHE / MODEL)
    adapter = Adapter.fresh("bench:train:0", "bench", f"HuggingFaceTB/{MODEL}", cfg, LoraSpec(rank=rank), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in (*adapter.weights.parameters(), *adapter.opt.exp_avg.values(), *adapter.opt.exp_avg_sq.values()):
            t.copy_(torch.rand(t.shape, generator=gen))
    return adapter.state_files("float32")


@contextmanager
def checkpoints_server(s3: LocalS3) -> Iterator[str]:
    """A ``python -m lathe.checkpoints`` process over ``s3``; yields its ``host:port``."""
    proc = subprocess.Popen([sys.executable, "-m", "lathe.checkpoints", "--port", "0", "--root", f"{s3.url}/bench",
                             "--sweep-interval", "3600"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **s3.env()})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready line, or "" if it died
        if READY_MARK not in line:
            raise RuntimeError(f"lathe.checkpoints did not start (exit {proc.poll()}): {line!r}")
        yield line.strip().rsplit(" ", 1)[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def timed(fn: Callable[[int], None], i: int) -> float:
    t = time.perf_counter()
    fn(i)
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> dict[str, float]:
    files = training_state(args.rank)
    total = sum(map(len, files.values()))
    with tempfile.TemporaryDirectory(prefix="lathe-ckpt-bench-") as tmp, LocalS3(Path(tmp)) as s3, \
            checkpoints_server(s3) as target, CheckpointsClient(target) as client:
        minio = s3.client()

        def service_save(i: int) -> None:
            client.put(tenant="bench", run_id="bench:train:0", kind="weights", name=f"s{i}", files=files)

        def service_load(i: int) -> None:
            got = client.get(tenant="bench", path=f"tinker://bench:train:0/weights/s{i}")
            assert sum(map(len, got.values())) == total

        def direct_save(i: int) -> None:
            for name, data in files.items():
                minio.put_object(s3.bucket, f"direct/{i}/{name}", io.BytesIO(data), len(data), part_size=PART_BYTES)

        def direct_load(i: int) -> None:
            n = 0
            for name in files:
                response = minio.get_object(s3.bucket, f"direct/{i}/{name}")
                try:
                    n += sum(len(c) for c in response.stream(4 << 20))
                finally:
                    response.close()
                    response.release_conn()
            assert n == total

        def direct_kept(i: int) -> None:
            kept = {}
            for name in files:
                response = minio.get_object(s3.bucket, f"direct/{i}/{name}")
                try:
                    kept[name] = response.read()
                finally:
                    response.close()
                    response.release_conn()
            assert sum(map(len, kept.values())) == total

        ops = {"service_save": service_save, "direct_save": direct_save, "service_load": service_load,
               "direct_load": direct_load, "direct_kept": direct_kept}
        service_save(-1), direct_save(-1)  # warm-up: connections, first volume allocation
        times: dict[str, list[float]] = {k: [] for k in ops}
        for i in range(args.repeats):
            for k, fn in ops.items():
                times[k].append(timed(fn, i))
    mbps = {k: total / 1e6 / statistics.median(v) for k, v in times.items()}
    return {"bytes": total, **mbps, "save_ratio": mbps["service_save"] / mbps["direct_save"],
            "load_ratio": mbps["service_load"] / mbps["direct_load"],
            "kept_ratio": mbps["service_load"] / mbps["direct_kept"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--append", action="store_true", help="append the figures to bench/RESULTS.md")
    args = ap.parse_args()
    r = run(args)
    summary = (f"SmolLM2-135M rank-{args.rank} training state, {r['bytes'] / 1e6:.1f} MB, median of {args.repeats}: "
               f"save {r['service_save']:.0f} MB/s through the services vs {r['direct_save']:.0f} MB/s direct "
               f"(**{r['save_ratio']:.2f}**); load {r['service_load']:.0f} vs {r['direct_load']:.0f} MB/s streamed "
               f"and dropped (**{r['load_ratio']:.2f}**), vs {r['direct_kept']:.0f} MB/s read into bytes "
               f"(**{r['kept_ratio']:.2f}**)")
    print(summary)
    print(cpu_line())
    if args.append:
        command = "OMP_NUM_THREADS=1 .venv/bin/python bench/bench_checkpoints.py " + " ".join(sys.argv[1:])
        with (REPO / "bench" / "RESULTS.md").open("a") as f:
            f.write(f"\n## Checkpoints in S3: services vs direct minio (`bench/bench_checkpoints.py`)\n\n"
                    f"`{command}` against a local SeaweedFS (`weed mini`) on {cpu_line()}:\n\n- {summary}; "
                    "target >= 0.8 of direct.\n")


if __name__ == "__main__":
    main()
