"""The door clients of tests/test_hostile_isolation.py, for a stack deployed as it runs in production: one
tenant's views of both public doors behind TLS (gRPC and the Tinker HTTP door) and the stack's internal
services."""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from lathe.channels import CHANNEL_OPTIONS
from lathe.stack import Stack
from lathe.v1 import lathe_pb2 as pb
from lathe.v1 import lathe_pb2_grpc as pb_grpc

WAIT_S = 60.0


@dataclass(slots=True)
class Secured:
    stack: Stack
    root_cert: bytes
    cert_path: Path

    def grpc(self, key: str) -> Grpc:
        return Grpc(self, key)

    def http(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=f"{self.stack.http_url}/api/v1", headers={"X-API-Key": key},
                            timeout=WAIT_S, verify=ssl.create_default_context(cafile=self.cert_path))

    def internal(self, name: str) -> grpc.Channel:
        address = next(s.address for s in self.stack.services if s.name == name)
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class Grpc:
    """One tenant's raw view of the gRPC door (over TLS)."""

    def __init__(self, secured: Secured, key: str) -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=secured.root_cert)
        self.channel = grpc.secure_channel(secured.stack.gateway, creds, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.GatewayStub(self.channel)
        self.md = (("x-api-key", key),)

    def call(self, rpc: str, request: object) -> object:
        return getattr(self.stub, rpc)(request, metadata=self.md, timeout=WAIT_S)

    def result(self, request_id: str) -> pb.FutureResult:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            res = self.call("RetrieveFuture", pb.RetrieveFutureRequest(request_id=request_id, timeout_s=5.0))
            if res.done:
                return res
        raise TimeoutError(request_id)

    def done(self, sub: pb.SubmitResponse, kind: str) -> pb.FutureResult:
        res = self.result(sub.request_id)
        assert res.WhichOneof("result") == kind, res
        return res

    def outcome(self, rpc: str, request: object) -> tuple[str, str]:
        """(status, message) of a call, following an accepted submission to its result."""
        try:
            res = self.call(rpc, request)
        except grpc.RpcError as e:
            return e.code().name, e.details()
        if isinstance(res, pb.SubmitResponse):
            fut = self.result(res.request_id)
            if fut.WhichOneof("result") == "error":
                return fut.error.code, fut.error.message
            return "ACCEPTED", str(fut)
        return "ANSWERED", str(res)
