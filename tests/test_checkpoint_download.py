"""Tinker's download path against Lathe: ``save_weights_external`` → ``get_external_weights_urls`` → the cookbook's
``weights.download`` and ``build_hf_model`` give a Hugging Face model equal to Lathe's own merge, through the
official SDK unchanged; signed URLs refuse tampering, expiry and other tenants; an export whose future a gateway
restart lost is built by the next URL request; the ``tinker checkpoint download`` CLI fetches an export from S3
(SeaweedFS with auth) byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyrage
import pytest
import tinker
import torch
from safetensors.torch import load_file

from lathe.checkpoints.client import CheckpointsClient
from lathe.checkpoints.seaweed import LocalS3
from lathe.errors import PermissionDenied
from lathe.export import export_merged
from lathe.gateway.auth import ApiKeys
from lathe.gateway.downloads import EXPORT_NOTE_KEY, ExportNote, UrlSigner
from lathe.runtime.internal_auth import TOKEN_ENV
from lathe.stack import Stack, StackConfig
from lathe.trainer.dist import free_port
from tests.helpers import next_token_datum

weights = pytest.importorskip("tinker_cookbook.weights")


def test_a_signed_url_refuses_tampering_and_expiry() -> None:
    now = [1000.0]
    signer = UrlSigner.from_secret("stack-secret")
    signer.clock = lambda: now[0]
    token = signer.sign("alice", "tinker://r/external_weights/x", "adapter_config.json", 1060)
    assert signer.verify(token) == ("alice", "tinker://r/external_weights/x", "adapter_config.json")
    assert UrlSigner.from_secret("stack-secret").sign("alice", "tinker://r/external_weights/x",
                                                      "adapter_config.json", 1060) == token  # replicas agree
    body, _, mac = token.partition(".")
    forged = UrlSigner.from_secret("other").sign("bob", "tinker://r/external_weights/x", "adapter_config.json", 1060)
    for bad in (f"{forged.partition('.')[0]}.{mac}", f"{body}.{forged.partition('.')[2]}"):
        with pytest.raises(PermissionDenied, match="signature does not match"):
            signer.verify(bad)
    with pytest.raises(PermissionDenied, match="malformed"):
        signer.verify("x.y")
    now[0] = 1060.0
    with pytest.raises(PermissionDenied, match="expired at unix time 1060"):
        signer.verify(token)


def _train(sc: tinker.ServiceClient) -> tinker.TrainingClient:
    tc = sc.create_lora_training_client(base_model="lathe/tiny-llama", rank=4)
    tc.forward_backward([next_token_datum(range(5, 25), tinker)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    return tc


def test_the_cookbook_downloads_and_merges_an_export(stack: Stack, tiny_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-dl-alice")
    sc = tinker.ServiceClient(base_url=stack.http_url)
    tc = _train(sc)
    path = tc.save_weights_external("final").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/final"
    rc = tinker.RestClient(base_url=stack.http_url)
    listed = {c.tinker_path: c.checkpoint_type for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed == {path: "external"}  # the sampler snapshot it was made from is gone
    assert rc.get_training_run(tc.model_id).result().last_sampler_checkpoint is None  # and was never the run's

    got = rc.get_external_weights_urls(path).result()
    assert sorted(got.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert got.expires.tzinfo is not None and got.expires.timestamp() > time.time() + 3000

    adapter = Path(weights.download(tinker_path=path, output_dir=str(tmp_path / "adapter"), base_url=stack.http_url))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["peft_type"]) == (4, "LORA")
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for n, t in lora.items() if "lora_B" in n)  # trained, not the zero init

    weights.build_hf_model(base_model=str(tiny_dir), adapter_path=str(adapter), output_path=str(tmp_path / "hf"),
                           merge_strategy="full", dtype="float32")
    ours = export_merged(adapter, tmp_path / "ours", base_dir=tiny_dir)
    theirs = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    mine, base = load_file(str(ours / "model.safetensors")), load_file(str(tiny_dir / "model.safetensors"))
    changed = [k for k in base if not torch.equal(mine[k], base[k])]
    assert changed  # the merge changed weights, and both merges agree on every one of them
    for k in changed:
        torch.testing.assert_close(theirs[k], mine[k], atol=1e-6, rtol=1e-5)

    # the signed URL is the authority: another tenant's key sees no such checkpoint, an altered URL is refused
    bob = tinker.RestClient(base_url=stack.http_url, api_key="tml-dl-bob")
    with pytest.raises(tinker.NotFoundError, match="not found"):
        bob.get_external_weights_urls(path).result()
    url = got.urls["adapter_config.json"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url[:-3] + ("AAA" if not url.endswith("AAA") else "BBB"))
    assert refused.value.code == 403 and "signature does not match" in refused.value.read().decode()
    sc.close("success").result()


def test_an_encrypted_export_decrypts_with_the_callers_key(stack: Stack, tmp_path: Path) -> None:
    sc = tinker.ServiceClient(base_url=stack.http_url, api_key="tml-dl-age")
    tc = _train(sc)
    identity = pyrage.x25519.Identity.generate()
    path = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]).result().path
    rc = tinker.RestClient(base_url=stack.http_url, api_key="tml-dl-age")
    urls = rc.get_external_weights_urls(path).result().urls
    assert sorted(urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    sealed = urllib.request.urlopen(urls["adapter_config.json.age"]).read()
    assert b'"peft_type"' not in sealed
    assert json.loads(pyrage.decrypt(sealed, [identity]))["r"] == 4
    sc.close("success").result()


def test_an_export_a_gateway_restart_lost_is_built_by_the_next_urls_request(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state a restart between the staging snapshot's save and the future's retrieval leaves: the snapshot, with
    its ``ExportNote``. The next ``external_weights_urls`` builds the export as asked (encrypted to the recipient)
    and removes the snapshot."""
    key, run = "tml-dl-restart", "sess-late:train:0"
    identity = pyrage.x25519.Identity.generate()
    note = ExportNote("late", 0, (str(identity.to_public()),))
    peft = {"adapter_model.safetensors": os.urandom(5000), "adapter_config.json": b'{"r": 4}'}
    monkeypatch.setenv(TOKEN_ENV, stack.internal_token)
    with CheckpointsClient(stack.service("checkpoints").address) as c:
        c.put(tenant=ApiKeys.from_file(None).tenant(key), run_id=run, kind="sampler_weights", name="late.export",
              files=peft, metadata_json=json.dumps({"user_metadata": {EXPORT_NOTE_KEY: note.to_json()}}))
    rc = tinker.RestClient(base_url=stack.http_url, api_key=key)
    path = f"tinker://{run}/external_weights/late"
    urls = rc.get_external_weights_urls(path).result().urls
    assert {n: pyrage.decrypt(urllib.request.urlopen(u).read(), [identity]) for n, u in urls.items()} == {
        f"{n}.age": data for n, data in peft.items()}
    assert [c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints] == [path]
    with pytest.raises(tinker.NotFoundError):
        rc.get_external_weights_urls(f"tinker://{run}/external_weights/never").result()


@pytest.fixture(scope="module")
def s3_stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Stack]:
    """A stack whose checkpoints live in a SeaweedFS with auth (``s3://``, keys in the environment) that no client
    is meant to reach, as the chart's in-release MinIO: it presigns no URL (``LATHE_S3_PUBLIC_ENDPOINT=none``), and
    the gateway signs its own for the address clients reach its HTTP door at (``--http-public-url``; here
    ``localhost`` where the door listens on 127.0.0.1, as an Ingress's host differs from the pod's)."""
    port = free_port()
    with LocalS3(tmp_path_factory.mktemp("seaweed")) as s3, pytest.MonkeyPatch.context() as env:
        for name, value in {**s3.env(), "LATHE_S3_PUBLIC_ENDPOINT": "none"}.items():
            env.setenv(name, value)
        cfg = StackConfig(models="lathe/tiny-llama", store_root=f"{s3.url}/stack", cache_root=model_cache,
                          trainer_threads=1, sampler_threads=1, http_port=port,
                          gateway_args=("--http-public-url", f"http://localhost:{port}/"))
        with Stack(cfg) as s:
            yield s


def test_the_tinker_cli_downloads_an_export_from_s3(s3_stack: Stack, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    key = "tml-dl-cli"
    sc = tinker.ServiceClient(base_url=s3_stack.http_url, api_key=key)  # closed at the end: its stack stops first
    tc = _train(sc)
    path = tc.save_weights_external("cli").result().path
    urls = tinker.RestClient(base_url=s3_stack.http_url, api_key=key).get_external_weights_urls(path).result().urls
    port = s3_stack.http_url.rsplit(":", 1)[1]
    assert all(u.startswith(f"http://localhost:{port}/api/v1/") for u in urls.values())  # the door's, signed

    cli = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", path, "--output",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                         env={**os.environ, "TINKER_API_KEY": key, "TINKER_BASE_URL": s3_stack.http_url})
    assert cli.returncode == 0, cli.stderr
    got = {p.name: p.read_bytes() for p in (tmp_path / path.removeprefix("tinker://").replace("/", "_")).iterdir()}
    monkeypatch.setenv(TOKEN_ENV, s3_stack.internal_token)
    with CheckpointsClient(s3_stack.service("checkpoints").address) as c:
        assert got == c.get(tenant=ApiKeys.from_file(None).tenant(key), path=path)
    assert sorted(got) == ["adapter_config.json", "adapter_model.safetensors"]
    sc.close("success").result()
