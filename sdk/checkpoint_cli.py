"""``lathe checkpoints list|download|delete``, ``lathe runs list`` and ``lathe export``: operator commands
that talk to a checkpoints service (``--checkpoints HOST:PORT``) on behalf of one ``--tenant``.

Transfers stream to disk with a tqdm progress bar; ``export`` downloads a checkpoint, then writes a PEFT
adapter directory (``--peft DIR``) and/or a merged Hugging Face model (``--merged DIR``, needs torch).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from lathe.checkpoints.client import CheckpointsClient
from lathe.checkpoints.layout import CheckpointInfo


def _client(args: argparse.Namespace) -> CheckpointsClient:
    return CheckpointsClient(args.checkpoints)


def _download(client: CheckpointsClient, tenant: str, path: str, directory: Path) -> CheckpointInfo:
    with tqdm(unit="B", unit_scale=True, desc=f"download {path}") as bar:
        def progress(n: int, total: int) -> None:
            bar.total = total
            bar.update(n)

        return client.download(tenant=tenant, path=path, directory=directory, on_bytes=progress)


def _list(args: argparse.Namespace) -> None:
    with _client(args) as c:
        page = c.list(tenant=args.tenant, run_id=args.run, limit=args.limit, offset=args.offset)
    for i in page.checkpoints:
        print(f"{i.path}\t{i.size_bytes}\t{i.created_at:.0f}\t{i.expires_at:.0f}")
    print(f"({len(page.checkpoints)} of {page.total_count})")


def _download_cmd(args: argparse.Namespace) -> None:
    with _client(args) as c:
        _download(c, args.tenant, args.path, args.dir)


def _delete(args: argparse.Namespace) -> None:
    with _client(args) as c:
        c.delete(tenant=args.tenant, path=args.path)
    print(f"deleted {args.path}")


def _runs(args: argparse.Namespace) -> None:
    with _client(args) as c:
        checkpoints = c.list(tenant=args.tenant).checkpoints
    runs: dict[str, list[CheckpointInfo]] = defaultdict(list)
    for i in checkpoints:
        runs[i.run_id].append(i)
    for run_id, items in runs.items():
        print(f"{run_id}\t{len(items)} checkpoints\t{sum(i.size_bytes for i in items)} bytes\t"
              f"last {max(i.created_at for i in items):.0f}")


def _export(args: argparse.Namespace) -> None:
    from lathe.export import export_merged, export_peft

    if not (args.peft or args.merged):
        raise SystemExit("lathe export: give --peft DIR and/or --merged DIR")
    with _client(args) as c, tempfile.TemporaryDirectory() as tmp:
        info = _download(c, args.tenant, args.path, Path(tmp))
        meta = json.loads(info.metadata_json or "{}")
        base = args.base or args.cache / str(meta.get("base_model", "")).rsplit("/", 1)[-1]
        if args.peft:
            print(export_peft(Path(tmp), args.peft, base_dir=base, tinker_path=args.path, source_metadata=meta))
        if args.merged:
            print(export_merged(Path(tmp), args.merged, base_dir=base, tinker_path=args.path, source_metadata=meta))


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``checkpoints``, ``runs`` and ``export`` on the ``lathe`` command's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--checkpoints", default="127.0.0.1:8502", help="the checkpoints service, HOST:PORT")
    common.add_argument("--tenant", required=True, help="the tenant whose checkpoints these are")

    ckpt = sub.add_parser("checkpoints", help="list, download or delete checkpoints").add_subparsers(
        dest="action", required=True)
    p = ckpt.add_parser("list", parents=[common])
    p.add_argument("--run", default="", help="one run id (default: all of the tenant's)")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--offset", type=int, default=0)
    p.set_defaults(fn=_list)
    p = ckpt.add_parser("download", parents=[common])
    p.add_argument("path", help="tinker://<run>/<kind>/<name>")
    p.add_argument("dir", type=Path)
    p.set_defaults(fn=_download_cmd)
    p = ckpt.add_parser("delete", parents=[common])
    p.add_argument("path")
    p.set_defaults(fn=_delete)

    runs = sub.add_parser("runs", help="the tenant's runs").add_subparsers(dest="action", required=True)
    runs.add_parser("list", parents=[common]).set_defaults(fn=_runs)

    p = sub.add_parser("export", parents=[common], help="export a checkpoint as a PEFT adapter or a merged model")
    p.add_argument("path", help="tinker://<run>/<kind>/<name>")
    p.add_argument("--peft", type=Path, default=None, help="write a PEFT adapter directory here")
    p.add_argument("--merged", type=Path, default=None, help="write a merged Hugging Face model directory here")
    p.add_argument("--base", type=Path, default=None, help="base model directory (default: from the metadata)")
    p.add_argument("--cache", type=Path, default=Path(".cache/lathe"), help="model cache directory")
    p.set_defaults(fn=_export)
