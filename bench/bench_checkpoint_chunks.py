"""What the size of a checkpoint's chunks costs the services that move it: CPU seconds of one save of a recovery
snapshot's bytes through a ``python -m lathe.checkpoints`` process over a local directory, per chunk size.

    python bench/bench_checkpoint_chunks.py [--rank 16] [--repeats 4] [--chunks 65536,262144,524288,4194304]

The state is the trainer's own (``bench_checkpoints.training_state``: a SmolLM2-135M adapter's weights and Adam
moments, ~69 MB at rank 16, what a recovery snapshot holds). For each chunk size (``store.CHUNK_BYTES``, which the
client streams in) the sizes take turns, one save at a time, ``--repeats`` rounds; prints the median CPU seconds of
the service process and of this client process per save, the save's wall time, and each against the shipped size.
The floor beside them: the service must hash the bytes (sha256) and write them, timed here on this process.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench_checkpoints import training_state
from machine import cpu_line, cpu_seconds

import lathe.checkpoints.client as client_module
from lathe.checkpoints.client import CheckpointsClient
from lathe.checkpoints.store import CHUNK_BYTES


def floor_s(files: dict[str, bytes], directory: str) -> float:
    """Seconds to sha256 ``files`` and write them to ``directory`` once (the work a save cannot skip)."""
    start = time.perf_counter()
    for name, data in files.items():
        hashlib.sha256(data).hexdigest()
        with open(f"{directory}/{name}", "wb") as f:
            f.write(data)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--chunks", default="65536,262144,524288,4194304", help="chunk sizes in bytes, comma-separated")
    args = ap.parse_args()
    sizes = [int(c) for c in args.chunks.split(",")]
    files = training_state(args.rank)
    total = sum(map(len, files.values()))
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.Popen([sys.executable, "-m", "lathe.checkpoints", "--root", root], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            port = next(int(m.group(1)) for line in proc.stdout if (m := re.search(r"127\.0\.0\.1:(\d+)", line)))
            client = CheckpointsClient(f"127.0.0.1:{port}")
            runs: dict[int, list[tuple[float, float, float]]] = {c: [] for c in sizes}
            for _ in range(args.repeats):
                for chunk in sizes:
                    client_module.CHUNK_BYTES = chunk
                    server0, client0, start = cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
                    client.put(tenant="t", run_id="r", kind="recovery", name="latest", files=files, overwrite=True)
                    runs[chunk].append((cpu_seconds(proc.pid) - server0, time.process_time() - client0,
                                        time.perf_counter() - start))
            floor = min(floor_s(files, scratch) for _ in range(3))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"one save of {total / 1e6:.1f} MB (rank {args.rank}), median of {args.repeats}; {cpu_line()}")
    print(f"floor: sha256 + one file write of the bytes on this process: {floor:.3f} s")
    med = {c: [statistics.median(r[i] for r in runs[c]) for i in range(3)] for c in sizes}
    base = med.get(CHUNK_BYTES)
    print(f"{'chunk KiB':>10}{'service CPU s':>15}{'client CPU s':>14}{'wall s':>9}{'service / floor':>17}"
          f"{'service vs shipped':>20}")
    for c in sizes:
        service, client_s, wall = med[c]
        ratio = f"{service / base[0]:.2f}x" if base else "-"
        shipped = " (shipped)" if c == CHUNK_BYTES else ""
        print(f"{c >> 10:>10}{service:>15.3f}{client_s:>14.3f}{wall:>9.3f}{service / floor:>17.2f}{ratio:>20}{shipped}")


if __name__ == "__main__":
    main()
