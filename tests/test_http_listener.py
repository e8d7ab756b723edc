"""The HTTP servers' listening socket: connections it accepts under asyncio have Nagle's algorithm off.

With Nagle on, a response written as headers then body waits for the client's delayed ACK of the headers (about 40
ms on Linux) on every request of a kept-alive connection; asyncio turns it off only on sockets whose protocol is TCP.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from lathe.runtime.serving import http_listener


async def _accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection accepted by an asyncio server on ``listener``."""
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
    try:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, timeout=10)
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_send_without_waiting_for_acks() -> None:
    """(A socket from ``socket.create_server``, protocol 0, gave 0 here under Python 3.11: the 44 ms stall.)"""
    assert asyncio.run(_accepted_nodelay(http_listener("127.0.0.1", 0))) == 1


def test_the_listener_binds_the_port_it_is_given_and_refuses_a_taken_one() -> None:
    first = http_listener("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        assert port > 0 and first.proto == socket.IPPROTO_TCP
        with pytest.raises(OSError):
            http_listener("127.0.0.1", port)
    finally:
        first.close()
