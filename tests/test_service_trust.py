"""Trust at start-up: API keys from a file, held as digests; open mode and secretless internal services refused
off loopback; the shared secret read from the environment or a file. (The stack-level checks through real doors
and internal services are in ``test_hostile_isolation.py``.)"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lathe.errors import FailedPrecondition, Unauthenticated
from lathe.gateway.auth import ApiKeys
from lathe.runtime.internal_auth import (
    METADATA_KEY,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    RequireToken,
    internal_aio_channel,
    internal_channel,
    is_loopback,
    load_token,
    server_interceptors,
)


def test_api_keys_file_maps_plain_and_hashed_keys_and_keeps_only_digests(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# comment\n\ntml-alice = alice\nsha256:{hashlib.sha256(b'tml-bob').hexdigest()}=bob\n")
    keys = ApiKeys.from_file(keys_file)
    assert (keys.tenant("tml-alice"), keys.tinker_tenant("tml-bob")) == ("alice", "bob")
    assert "tml-alice" not in repr(keys) and not keys.open_mode
    for wrong in ("tml-carol", "tml-alice ", hashlib.sha256(b"tml-bob").hexdigest()):
        with pytest.raises(Unauthenticated, match="unknown API key"):
            keys.tenant(wrong)
    with pytest.raises(Unauthenticated, match="missing API key"):
        keys.tenant("")


@pytest.mark.parametrize(("text", "pattern"), [("tml-a\n", "line 1: not of the form"), ("=t\n", "line 1"),
                                               ("# nothing\n", "configure no key")])
def test_api_keys_file_errors_name_the_line(tmp_path: Path, text: str, pattern: str) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        ApiKeys.from_file(keys_file)


def test_open_mode_gives_each_key_its_own_tenant_on_loopback_only() -> None:
    keys = ApiKeys.from_file(None)
    assert keys.open_mode and keys.tenant("tml-a") != keys.tenant("tml-b")
    keys.require_safe("127.0.0.1")
    keys.require_safe("::1")
    with pytest.raises(FailedPrecondition, match="open mode"):
        keys.require_safe("0.0.0.0")


def _refused_start(args: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and " listening on " not in proc.stdout, proc
    return proc.stderr


def test_gateway_refuses_open_mode_and_half_tls_off_loopback(tmp_path: Path) -> None:
    internal = ["--trainer", "127.0.0.1:1", "--checkpoints", "127.0.0.1:1", "--sampler", "127.0.0.1:1"]
    assert "open mode" in _refused_start(["lathe.gateway", "--host", "0.0.0.0", *internal])
    assert "--tls-cert and --tls-key go together" in _refused_start(
        ["lathe.gateway", "--host", "127.0.0.1", "--tls-cert", str(tmp_path / "c.pem"), *internal])


def test_internal_service_refuses_to_listen_off_loopback_without_the_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    err = _refused_start(["lathe.checkpoints", "--host", "0.0.0.0", "--root", str(tmp_path)], env)
    assert TOKEN_ENV in err
    with pytest.raises(FailedPrecondition, match=TOKEN_ENV):
        server_interceptors("lathe.trainer", "10.0.0.5", environ={})
    assert server_interceptors("lathe.trainer", "127.0.0.1", environ={}) == []
    assert len(server_interceptors("lathe.trainer", "0.0.0.0", environ={TOKEN_ENV: "s3cret"})) == 1


def test_the_secret_comes_from_a_file_before_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert load_token({TOKEN_ENV: "from-env", TOKEN_FILE_ENV: str(token_file)}) == "from-file"
    assert load_token({TOKEN_ENV: " from-env "}) == "from-env"
    assert load_token({}) == ""
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost", "0.0.0.0", "10.1.2.3",
                                     "example.com")] == [True, True, True, True, True, False, False, False]


def _seen(context: grpc.aio.ServicerContext) -> bytes:
    return dict(context.invocation_metadata())[METADATA_KEY].encode()


async def _unary_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return _seen(context)


async def _unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield _seen(context)


async def _stream_unary(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    return b"".join([r async for r in requests]) + _seen(context)


async def _stream_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r + _seen(context)


async def _calls_of_every_kind(channel: grpc.aio.Channel) -> list[Any]:
    """One call of each kind through ``channel``: what the service saw as the secret, or the status code."""
    async def outcome(call: Any) -> Any:  # a unary answer or a stream
        try:
            return [m async for m in call] if hasattr(call, "__aiter__") else await call
        except grpc.aio.AioRpcError as e:
            return e.code()

    return [await outcome(channel.unary_unary("/t.Echo/UnaryUnary")(b"")),
            await outcome(channel.unary_stream("/t.Echo/UnaryStream")(b"")),
            await outcome(channel.stream_unary("/t.Echo/StreamUnary")(iter([b"a:"]))),
            await outcome(channel.stream_stream("/t.Echo/StreamStream")(iter([b"b:"])))]


def test_internal_channels_send_the_secret_with_every_kind_of_call() -> None:
    """The asyncio channel once dropped the secret on streaming calls (the gateway's GetStream got refused)."""
    async def main() -> tuple[list[Any], list[Any], list[Any]]:
        server = grpc.aio.server(interceptors=[RequireToken("s3cret")])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Echo", {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary_unary),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
            "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream)})])
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with internal_aio_channel(target, [], token="s3cret") as ch:
                held = await _calls_of_every_kind(ch)
            async with internal_aio_channel(target, [], token="") as ch:
                without = await _calls_of_every_kind(ch)
            blocking = internal_channel(target, [], token="s3cret")
            with blocking:
                sync = await asyncio.to_thread(lambda: [
                    blocking.unary_unary("/t.Echo/UnaryUnary")(b""),
                    list(blocking.unary_stream("/t.Echo/UnaryStream")(b"")),
                    blocking.stream_unary("/t.Echo/StreamUnary")(iter([b"a:"])),
                    list(blocking.stream_stream("/t.Echo/StreamStream")(iter([b"b:"])))])
            return held, without, sync
        finally:
            await server.stop(None)

    held, without, sync = asyncio.run(main())
    expected = [b"s3cret", [b"s3cret"], b"a:s3cret", [b"b:s3cret"]]
    assert held == expected and sync == expected
    assert without == [grpc.StatusCode.UNAUTHENTICATED] * 4
