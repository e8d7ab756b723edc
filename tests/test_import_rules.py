"""The layout table of docs/architecture.md, enforced: which room may import which.

Every module of every Lathe package is read with ``ast`` (imports at the top and inside functions alike) and
each import is checked against its room's row below, the same table as docs/architecture.md's. In
particular the trainer and the sampler reach storage only through the checkpoints service's client
(never ``minio``, never an object store) and import no SDK client module; the gateway, the SDK and the
checkpoints service never import torch. A module that belongs to no room fails the test until the table
names it. A second test imports every module of the SDK and the gateway in a fresh interpreter and checks
that torch was not loaded (what the static walk cannot see: an import through another module).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# import name -> folder, as pyproject's package-dir maps them (the generated protos, lathe.v1, left out)
PACKAGES = {name: folder for name, folder in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
            ["setuptools"]["package-dir"].items() if name != "lathe.v1"}

# the lathe package (sdk/) holds three rooms: what every room shares, the client SDK, and the operator's tools;
# lathe.runtime (runtime/) is how a service process runs, for the services and the tools that start them
SHARED = ("lathe.errors", "lathe.types", "lathe.registry_types", "lathe.wire", "lathe.info_wire", "lathe.channels",
          "lathe.backoff", "lathe.loss_graph", "lathe.loss_shapes", "lathe.v1")
RUNTIME = ("lathe.runtime",)
CLIENT = ("lathe.service_client", "lathe.training_client", "lathe.sampling_client", "lathe.rest_client",
          "lathe.registry_wire", "lathe.futures", "lathe.connect", "lathe.tokenizer", "lathe.loss_trace")
TOOLS = ("lathe.cli", "lathe.checkpoint_cli", "lathe.export", "lathe.stack", "lathe.stack_config",
         "lathe.stack_child")
POOL = ("lathe.models", "lathe.kernels")
STORAGE = ("minio", "boto3", "sqlalchemy")
TORCH = ("torch", "safetensors.torch", "triton", "transformers")


@dataclass(frozen=True)
class Room:
    name: str
    modules: tuple[str, ...]  # module names (a package name covers its modules)
    may_import: tuple[str, ...]  # Lathe modules allowed (prefixes); its own modules always are
    never: tuple[str, ...]  # third-party packages it must not import, even inside a function
    never_eager: tuple[str, ...] = ()  # ... and those it may import only inside a function (when a user asks)


ROOMS = [
    # Tinker's TensorData.to_torch / from_torch and forward_backward_custom import torch when called
    Room("shared", SHARED, SHARED, STORAGE, TORCH),
    # get_tokenizer builds a transformers tokenizer (from a built-in model's files: the catalog) when called
    Room("SDK client", ("lathe",) + CLIENT, SHARED + CLIENT + ("lathe.models.catalog",), STORAGE, TORCH),
    Room("runtime", RUNTIME, SHARED, STORAGE + TORCH),
    Room("tools", TOOLS, SHARED + RUNTIME + ("lathe.checkpoints",), STORAGE, TORCH),  # export --merged needs torch
    Room("gateway", ("lathe.gateway",), SHARED + RUNTIME, TORCH + ("minio", "boto3")),
    Room("trainer", ("lathe.trainer",), SHARED + RUNTIME + POOL + ("lathe.checkpoints.client",), STORAGE),
    # the sglang engine publishes adapters as PEFT directories with the export tool's writer (lathe.export.write_peft)
    Room("sampler", ("lathe.sampler",), SHARED + RUNTIME + POOL + ("lathe.checkpoints.client", "lathe.export"),
         STORAGE),
    Room("checkpoints", ("lathe.checkpoints",), SHARED + RUNTIME, TORCH + ("sqlalchemy",)),
    Room("models", ("lathe.models",), ("lathe.kernels",), ("grpc",) + STORAGE),
    Room("kernels", ("lathe.kernels",), (), ("grpc",) + STORAGE),
]


def covers(prefix: str, name: str) -> bool:
    """Whether ``prefix`` names module ``name`` or a package holding it (``lathe`` names only the root)."""
    return name == prefix or (prefix != "lathe" and name.startswith(prefix + "."))


def room_of(module: str) -> Room | None:
    """The room whose longest listed name covers ``module`` (``lathe.trainer`` before ``lathe``)."""
    best: tuple[int, Room] | None = None
    for room in ROOMS:
        for name in room.modules:
            if covers(name, module) and (best is None or len(name) > best[0]):
                best = (len(name), room)
    return best[1] if best else None


def modules() -> dict[str, Path]:
    """Every module of every package (generated protos excepted) by its import name."""
    out = {}
    for package, folder in PACKAGES.items():
        root = REPO / folder
        assert root.is_dir(), f"pyproject maps {package} to {folder}/, which does not exist"
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[0] == "v1" and package == "lathe":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            if "migrations" in parts:  # alembic scripts: run by the migration tool, not imported
                continue
            out[".".join([package, *parts])] = path
    return out


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, eager) for every import in ``path``: eager when it runs as the module is imported
    (not inside a function, not under ``if TYPE_CHECKING``). ``from a import b`` names ``a.b`` when that is a
    module; a relative import is resolved against ``module``."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            eager = False
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, eager)
            return
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno, eager) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts[: len(parts) - (node.level - (1 if is_package else 0))]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.extend((f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno, eager)
                         for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def offences(room: Room, module: str, path: Path, known: set[str]) -> list[str]:
    """The imports of ``module`` (in ``path``) that its room's row does not allow."""
    out = []
    for name, line, eager in imports(module, path, known):
        if name == "lathe" or name.startswith("lathe."):
            allowed = any(covers(p, name) for p in room.modules + room.may_import)
        else:
            allowed = not any(covers(p, name) for p in room.never + (room.never_eager if eager else ()))
        if not allowed:
            out.append(f"{path.name}:{line}: {room.name} module {module} imports {name}"
                       + ("" if eager else " (inside a function)"))
    return out


def test_every_module_imports_only_what_its_room_may() -> None:
    found = modules()
    known = set(found) | {"lathe.v1"}
    homeless = [m for m in found if room_of(m) is None]
    assert homeless == [], f"modules in no room of the layout table: {homeless}"
    assert [o for m, path in found.items() for o in offences(room_of(m), m, path, known)] == []


def test_the_rules_catch_a_trainer_that_reaches_for_storage_or_the_sdk(tmp_path: Path) -> None:
    assert [room_of(m).name for m in ("lathe.trainer.engine", "lathe.training_client", "lathe", "lathe.export",
                                      "lathe.checkpoints.client", "lathe.v1.lathe_pb2", "lathe.runtime.serving")] == \
        ["trainer", "SDK client", "SDK client", "tools", "checkpoints", "shared", "runtime"]
    assert room_of("lathe.no_such_module") is None
    bad = tmp_path / "bad.py"
    bad.write_text("import minio\nfrom lathe.checkpoints.store import open_store\n"
                   "from lathe.checkpoints import client\n"
                   "def f():\n    from lathe import training_client, errors\n    import torch\n")
    known = {"lathe.training_client", "lathe.errors", "lathe.checkpoints.store", "lathe.checkpoints.client"}
    assert offences(room_of("lathe.trainer"), "lathe.trainer.bad", bad, known) == [
        "bad.py:1: trainer module lathe.trainer.bad imports minio",
        "bad.py:2: trainer module lathe.trainer.bad imports lathe.checkpoints.store",
        "bad.py:5: trainer module lathe.trainer.bad imports lathe.training_client (inside a function)"]
    assert offences(room_of("lathe.gateway"), "lathe.gateway.bad", bad, known)[-1] == \
        "bad.py:6: gateway module lathe.gateway.bad imports torch (inside a function)"
    plumbing = tmp_path / "plumbing.py"
    plumbing.write_text("from lathe.runtime.serving import READY_MARK\n")
    known |= {"lathe.runtime.serving"}
    assert offences(room_of("lathe.futures"), "lathe.futures", plumbing, known) == [
        "plumbing.py:1: SDK client module lathe.futures imports lathe.runtime.serving"]
    assert offences(room_of("lathe.gateway"), "lathe.gateway.bad", plumbing, known) == []
    eager = tmp_path / "eager.py"
    eager.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nimport torch\n")
    assert offences(room_of("lathe.types"), "lathe.types", eager, known) == [
        "eager.py:4: shared module lathe.types imports torch"]


PROBE = """
import importlib, json, pkgutil, sys
names = ["lathe", "lathe.errors", "lathe.types", "lathe.wire", "lathe.futures", "lathe.runtime", "lathe.gateway"]
imported, culprit = [], None
for name in names:
    importlib.import_module(name)
    imported.append(name)
    culprit = culprit or (name if "torch" in sys.modules else None)
for package in (sys.modules["lathe"], sys.modules["lathe.runtime"], sys.modules["lathe.gateway"]):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
        culprit = culprit or (info.name if "torch" in sys.modules else None)
print(json.dumps({"imported": imported, "culprit": culprit}))
"""


@pytest.mark.processes
def test_sdk_runtime_and_gateway_import_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"lathe.service_client", "lathe.training_client", "lathe.rest_client",
            "lathe.v1.lathe_pb2", "lathe.runtime.serving", "lathe.runtime.probes"} <= set(report["imported"])
    assert report["culprit"] is None, f"importing {report['culprit']} imported torch"
