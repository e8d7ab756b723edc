"""The gRPC channel options every Lathe caller and server share (torch-free; the client SDK's and the services').

``CHANNEL_OPTIONS`` lets messages up to ``MAX_MESSAGE_BYTES`` through both ways (checkpoint bytes travel between
the services; the public gateway sets its own, much smaller receive limit). ``reconnect_options`` bounds how long
a channel waits before it tries again to reach a service that went away.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def reconnect_options(first_s: float, max_s: float) -> list[tuple[str, int]]:
    """Channel options that make a channel try to reconnect to a service that went away after ``first_s``, then
    at least every ``max_s``: a restarted service is found within its callers' retry backoff instead of gRPC's
    default of up to two minutes."""
    return [("grpc.initial_reconnect_backoff_ms", int(first_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(max_s * 1000))]
