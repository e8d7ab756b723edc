"""Lathe's own SDK over TLS, against a stack whose public doors serve a certificate signed by a private CA
(made here with ``openssl``).

Protects: a plaintext client is refused; a ``grpcs://`` client (or ``tls=True``) that trusts the private CA,
given as a file path or as PEM bytes, trains a step; a client trusting another CA fails at once with an
error that says the TLS handshake failed; and the base URL forms and certificate arguments are checked.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import lathe
from lathe.connect import channel_credentials, parse_base_url
from lathe.errors import Unavailable
from lathe.futures import RetryPolicy
from lathe.stack import Stack, StackConfig
from tests.helpers import next_token_datum

BASE = "lathe/tiny-llama"
KEY = "tml-tls"
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def private_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA certificate and its key."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    openssl("req", "-x509", *EC, "-days", "1", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    return cert, key


def server_certificate(folder: Path, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost signed by ``ca``, and its key."""
    cert, key, csr, ext = (folder / n for n in ("server.pem", "server.key", "server.csr", "server.ext"))
    openssl("req", *EC, "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(csr))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
            "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return cert, key


@dataclass(frozen=True, slots=True)
class Secured:
    stack: Stack
    ca: Path  # the CA that signed the gateway's certificate
    other_ca: Path  # a CA that signed nothing of this stack's


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_dir: Path) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("tls")
    ca = private_ca(folder, "lathe-test-ca")
    other_ca, _ = private_ca(folder, "someone-elses-ca")
    cert, key = server_certificate(folder, ca)
    cfg = StackConfig(models=BASE, store_root=folder / "store", cache_root=model_cache, trainer_threads=1,
                      sampler_threads=1, tls_cert=cert, tls_key=key)
    with Stack(cfg) as stack:
        yield Secured(stack, ca[0], other_ca)


def test_a_client_trusting_the_private_ca_trains_over_tls(secured: Secured) -> None:
    url = f"grpcs://{secured.stack.gateway}"
    with lathe.ServiceClient(url, KEY, root_certificates=secured.ca) as sc:
        tc = sc.create_lora_training_client(BASE, rank=4, seed=1)
        data = [next_token_datum([5, 17, 42, 9, 33, 7])]
        out = tc.forward_backward(data, "cross_entropy").result()
        step = tc.optim_step(lathe.AdamParams(learning_rate=0.05)).result()
        assert out.metrics["loss:sum"] > 0 and step.metrics
        after = tc.forward(data, "cross_entropy").result()
        assert after.metrics["loss:sum"] < out.metrics["loss:sum"]  # the step was applied
    # tls=True on a bare host:port, the CA as PEM bytes, through a standalone RestClient
    rest = lathe.RestClient(base_url=secured.stack.gateway, api_key=KEY, tls=True,
                            root_certificates=secured.ca.read_bytes())
    assert [m.model_name for m in rest.get_server_capabilities().result().supported_models] == [BASE]
    rest.close()


def test_a_plaintext_client_is_refused(secured: Secured) -> None:
    plain = lathe.ServiceClient(secured.stack.gateway, KEY, retry=RetryPolicy(budget_s=0))
    with plain, pytest.raises(Unavailable):
        plain.get_server_capabilities()


def test_a_client_trusting_another_ca_fails_at_once_saying_why(secured: Secured) -> None:
    wrong = lathe.ServiceClient(f"grpcs://{secured.stack.gateway}", KEY, root_certificates=secured.other_ca)
    with wrong, pytest.raises(Unavailable) as e:
        wrong.get_server_capabilities()  # with the default 120 s retry budget: not retried
    assert e.value.message.startswith(f"the TLS handshake with the gateway at {secured.stack.gateway} failed, so "
                                      "nothing was sent: its certificate must chain to root_certificates")
    assert "CERTIFICATE_VERIFY_FAILED" in e.value.message


@pytest.mark.parametrize(("url", "parsed"), [("grpcs://h:1", ("h:1", True)), ("https://h:1/", ("h:1", True)),
                                             ("grpc://h:1", ("h:1", False)), ("h:1", ("h:1", False))])
def test_base_url_schemes_choose_tls(url: str, parsed: tuple[str, bool]) -> None:
    assert parse_base_url(url) == parsed


def test_tls_arguments_are_checked(tmp_path: Path) -> None:
    assert channel_credentials("h:1", None, None) is None
    assert channel_credentials("h:1", True, None) is not None
    with pytest.raises(ValueError, match="tls=False contradicts base_url 'grpcs://h:1', which asks for TLS"):
        channel_credentials("grpcs://h:1", False, None)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match=r"root_certificates file '.*ca.txt' holds no PEM certificate"):
        channel_credentials("h:1", None, not_pem)
    with pytest.raises(ValueError, match=r"root_certificates: cannot read '.*missing.pem': No such file"):
        channel_credentials("h:1", None, tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="not a gateway address"):
        parse_base_url("http://h:1")
