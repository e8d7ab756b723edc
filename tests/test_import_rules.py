"""The SDK and the gateway never import torch: checked in a fresh interpreter, over every
module of the ``lathe`` SDK package (``sdk/``) and of ``lathe.gateway`` (``services/gateway/``), so that a
module added later is checked too."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib, json, pkgutil, sys
names = ["lathe", "lathe.errors", "lathe.types", "lathe.wire", "lathe.futures", "lathe.gateway"]
imported, culprit = [], None
for name in names:
    importlib.import_module(name)
    imported.append(name)
    culprit = culprit or (name if "torch" in sys.modules else None)
for package in (sys.modules["lathe"], sys.modules["lathe.gateway"]):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
        culprit = culprit or (info.name if "torch" in sys.modules else None)
print(json.dumps({"imported": imported, "culprit": culprit}))
"""


def test_sdk_and_gateway_import_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"lathe.service_client", "lathe.training_client", "lathe.rest_client",
            "lathe.v1.lathe_pb2"} <= set(report["imported"])
    assert report["culprit"] is None, f"importing {report['culprit']} imported torch"
