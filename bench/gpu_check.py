"""The GPU check: one run on a machine with an NVIDIA GPU, from a plain checkout, writing one report.

    python bench/gpu_check.py --out bench/gpu_report          the full check (an H200: under 8 minutes)
    python bench/gpu_check.py --smoke --out bench/gpu_smoke      tiny shapes; runs on a CPU-only machine too

No install and no network: the ``lathe`` packages are found in this checkout through the mapping of
pyproject.toml's ``[tool.setuptools.package-dir]`` (an import finder, nothing written). ``lathe`` itself
is made without running sdk/__init__.py (the gRPC client SDK); where the generated protobuf code
(``lathe.v1``) does not import (not generated, or another protobuf), a stub stands in that raises
ImportError on use: no section needs it, and the tests that do skip.

Sections (named in ``bench/gpu_sections.py``), each in its own child process with its own time limit, so a crash,
a hung kernel or a timeout loses that section only (what it recorded before stays):
    env        g. versions, GPU, CPU model and flags
    tests      a. the ``gpu``-marked tests (tests/test_gpu_pools.py, tests/test_cuda_graphs.py)
    exactness  c. ``lathe.models.exactness.self_check`` on the GPU decoder
    sgmv       b. SGMV/BGMV vs the torch reference; GB/s vs a device copy, rank 32
    cycle      d. 8 tenants x (1 x 128) forward_backward + optim_step, packed vs one tenant per cycle, 1B config
    sampler    e. 64 sequences over 8 adapters vs transformers + peft ``generate``; f. sampler-trainer KL
    bgmv       i. BGMV at a decode step's shape (64 rows): Triton vs the torch reference; GB/s vs a device copy
    decode     j. paged-KV decode attention; decode tokens/s with CUDA graphs on vs off; the slot-pool (BGMV)
               decode path vs the invariant per-segment path: tokens/s and logprob differences, 1B config
Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` after every section, prints the markdown at
the end. Every cache (Triton, CUDA, Hugging Face, pytest, tiny models) goes to ``--out``/.scratch, which is
removed at the end: nothing is written outside ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the checkout
REPO = Path(__file__).resolve().parents[1]

# name, title, time limit in seconds (each also gets at most what is left of --budget)
SECTIONS = [
    ("env", "g. environment", 30),
    ("tests", "a. gpu-marked tests", 100),
    ("exactness", "c. exactness self-check", 60),
    ("sgmv", "b. SGMV/BGMV kernels", 50),
    ("cycle", "d. 8-tenant clock cycle, 1B config", 70),
    ("sampler", "e/f. sampler throughput and sampler-trainer KL, 1B config", 240),
    ("ranks", "h. trainer pool collectives (NCCL), one rank", 40),
    ("bgmv", "i. BGMV at the decode shape", 40),
    ("decode", "j. paged-KV decode, CUDA graphs, slot pool vs invariant path, 1B config", 120),
]


# ---------------------------------------------------------------- imports without an install


class RepoPackages(importlib.abc.MetaPathFinder):
    """Finds the packages pyproject.toml maps to folders (``lathe.trainer`` -> services/trainer, ...)."""

    def __init__(self, repo: Path) -> None:
        setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
        self.dirs = {name: repo / folder for name, folder in setuptools["package-dir"].items()}

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = self.dirs.get(name)
        if folder is None:
            return None
        if name == "lathe":  # a bare package: sdk/__init__.py imports the gRPC client SDK, which no pool needs
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


class MissingModule(types.ModuleType):
    """Stands in for a module that does not import here; any use raises ImportError with the reason."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name)
        self.__reason = reason

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ImportError(f"{self.__name__} is not importable here: {self.__reason}")


def install_packages(*, stub_protos: bool) -> str:
    """Make ``lathe.*`` importable from this checkout; returns how ``lathe.v1`` was provided."""
    sys.meta_path.insert(0, RepoPackages(REPO))
    generated = ("lathe.v1.lathe_pb2", "lathe.v1.lathe_pb2_grpc")
    try:
        if stub_protos:
            raise ImportError("--stub-protos was given")
        for name in generated:
            importlib.import_module(name)
        return "generated code imported"
    except Exception as e:  # noqa: BLE001 - any failure (missing file, protobuf version check) means: stub it
        reason = f"{type(e).__name__}: {e}"
    package = importlib.import_module("lathe.v1")
    for name in generated:
        sys.modules[name] = MissingModule(name, reason)
        setattr(package, name.rsplit(".", 1)[1], sys.modules[name])
    return f"stub ({reason})"


# ---------------------------------------------------------------- the child: one section


def run_section(args: argparse.Namespace) -> None:
    protos = install_packages(stub_protos=args.stub_protos)
    import gpu_context
    import torch  # after the environment is set up by the parent
    from gpu_sections import SECTIONS

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scratch = args.out / ".scratch"
    ctx = gpu_context.Context(scratch / f"{args.child}.json", scratch, device, args.dtype,
                              gpu_context.SMOKE if args.smoke else gpu_context.FULL, protos)
    try:
        SECTIONS[args.child](ctx)
        if ctx.data["status"] == "running":
            ctx.data["status"] = "ok"
        ctx.write()
    except BaseException as e:  # noqa: BLE001 - recorded for the report; the parent goes on
        ctx.fail(e)


# ---------------------------------------------------------------- the parent: every section, one report


def child_env(scratch: Path) -> dict[str, str]:
    """The children's environment: every cache under ``scratch``, no bytecode, offline."""
    env = dict(os.environ)
    env.update(PYTHONDONTWRITEBYTECODE="1", LATHE_CACHE=str(scratch / "lathe-cache"),
               TRITON_HOME=str(scratch / "triton"), TRITON_CACHE_DIR=str(scratch / "triton" / "cache"),
               CUDA_CACHE_PATH=str(scratch / "nv"), HF_HOME=str(scratch / "hf"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", MPLCONFIGDIR=str(scratch / "mpl"), XDG_CACHE_HOME=str(scratch / "xdg"))
    return env


def run_child(args: argparse.Namespace, name: str, limit: float, scratch: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(args.out),
           "--dtype", args.dtype]
    cmd += ["--smoke"] * args.smoke + ["--stub-protos"] * args.stub_protos
    cmd += ["--device", args.device] if args.device else []
    log = scratch / f"{name}.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            rc: int | str = subprocess.run(cmd, cwd=REPO, env=child_env(scratch), stdout=f, stderr=subprocess.STDOUT,
                                           timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.monotonic() - t0
    path = scratch / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {"status": "crashed", "results": {}}
    if rc == "timeout":
        data.update(status="timeout", reason=f"killed after its limit of {limit:.0f} s")
    elif rc != 0 and data["status"] in ("running", "ok"):
        data.update(status="crashed", reason=f"child exited with {rc}")
    data.update(seconds=round(seconds, 1), limit_s=round(limit))
    if data["status"] not in ("ok", "skipped"):
        data["log_tail"] = log.read_text(errors="replace")[-4000:]
    return data


def _headline(sections: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(what, measured, target) for the issue's targets, from whatever the sections recorded."""
    def get(section: str, *keys: str) -> object:
        node: object = sections.get(section, {}).get("results", {})
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return "n/a" if node is None else node

    rows = [("gpu tests", str(get("tests", "counts")), "all passed")]
    for op in ("sgmv shrink", "sgmv expand, += base", "bgmv shrink", "lora fwd, triton"):
        rows.append((f"{op}: % of copy bandwidth", str(get("sgmv", "rows", op, "% of copy")), ">= 70"))
    rows.append(("exactness self-check exact", str(get("exactness", "exact")), "True"))
    rows.append(("bgmv delta at decode shape: % of copy bandwidth",
                 str(get("bgmv", "16 slots", "bgmv delta, triton", "% of copy")), "as high as it goes"))
    graphs = get("decode", "decode with CUDA graphs on vs off")
    if isinstance(graphs, dict) and all(f"invariant, base model, graphs {x}" in graphs for x in ("on", "off")):
        on, off = (graphs[f"invariant, base model, graphs {x}"]["tokens/s"] for x in ("on", "off"))
        rows.append(("decode tokens/s, CUDA graphs on / off", f"{on} / {off}", "on > off"))
    for path in ("per-segment LoRA", "sgmv"):
        rows.append((f"cycle packed / serial ({path})", str(get("cycle", path, "packed / serial")), ">= 3"))
    rows.append(("sampler / transformers+peft tokens/s",
                 str(get("sampler", "lathe / transformers (best lathe path)", "ratio")), ">= 3"))
    for path in ("per-segment LoRA", "sgmv"):
        kl = get("sampler", f"KL {path}")
        shown = "n/a" if not isinstance(kl, dict) else \
            f"KL {kl['KL (mean of sampler - trainer logprob)']}, max |d| {kl['max |delta logprob|']}, " \
            f"{kl['mismatched']}/{kl['tokens']} differ"
        rows.append((f"sampler-trainer KL ({path})", shown, "0.0"))
    return rows


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({'smoke' if report['smoke'] else 'full'}), {report['started']}", "",
             f"Command: `{report['command']}`; wall time {report['seconds']} s.", "",
             "| target | measured | wanted |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in _headline(report["sections"])]
    lines += ["", "| section | status | seconds (limit) | note |", "|---|---|---|---|"]
    for name, title, _ in SECTIONS:
        if name in report["sections"]:
            s = report["sections"][name]
            lines.append(f"| {title} | {s['status']} | {s.get('seconds', '')} ({s.get('limit_s', '')}) | "
                         f"{s.get('reason', '')[:200].replace('|', '/')} |")
    for name, title, _ in SECTIONS:
        s = report["sections"].get(name)
        if s is None:
            continue
        lines += ["", f"## {title}: {s['status']}", "", "```json", json.dumps(s.get("results", {}), indent=1), "```"]
        for key in ("traceback", "log_tail"):
            if s.get(key):
                lines += ["", f"{key}:", "```", s[key].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> str:
    text = markdown(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "gpu_report", help="report folder")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script itself, on any machine")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when torch sees one")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the base weights' dtype")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all sections together")
    p.add_argument("--sections", default=",".join(n for n, _, _ in SECTIONS), help="comma-separated subset")
    p.add_argument("--stub-protos", action="store_true", help="stub lathe.v1 even where the generated code imports")
    p.add_argument("--child", choices=[n for n, _, _ in SECTIONS], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if args.child:
        return run_section(args)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - {n for n, _, _ in SECTIONS})
    if unknown:
        p.error(f"unknown sections {unknown}")
    scratch = args.out / ".scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    start = time.monotonic()
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([sys.executable, *sys.argv]),
              "smoke": args.smoke, "seconds": 0.0, "sections": {}}
    text = write_report(args.out, report)
    try:
        for name, title, limit in SECTIONS:
            if name not in chosen:
                continue
            left = args.budget - (time.monotonic() - start)
            if left < 5:
                report["sections"][name] = {"status": "not run", "reason": "no time left in --budget", "results": {}}
            else:
                print(f"[gpu_check] {title} (limit {min(limit, left):.0f} s) ...", flush=True)
                report["sections"][name] = run_child(args, name, min(limit, left), scratch)
                print(f"[gpu_check]   {report['sections'][name]['status']} "
                      f"in {report['sections'][name]['seconds']} s", flush=True)
            report["seconds"] = round(time.monotonic() - start, 1)
            text = write_report(args.out, report)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(text)


if __name__ == "__main__":
    main()
