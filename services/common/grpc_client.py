"""The shared shape of every gRPC client: a channel, a deadline on every call, bounded retries.

Only idempotent calls retry, on UNAVAILABLE, with jittered exponential backoff; each retry is logged.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from services.common.errors import from_rpc_error

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


class GrpcClient:
    """Base of the service clients; a context manager that closes its channel."""

    service = "service"

    def __init__(self, addr: str, timeout_s: float = 10.0, max_retries: int = 3) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.addr = addr
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.metadata: tuple[tuple[str, str], ...] | None = None  # sent with every call (e.g. a bearer token)

    def call(self, method: Callable, request: Any, *, timeout_s: float | None = None,
             idempotent: bool = False) -> Any:
        name = getattr(method, "_method", b"").decode() if hasattr(method, "_method") else str(method)
        what = f"{self.service} {self.addr} {name.rsplit('/', 1)[-1]}"
        attempts = 1 + (self.max_retries if idempotent else 0)
        for attempt in range(attempts):
            try:
                return method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                retryable = err.code() == grpc.StatusCode.UNAVAILABLE and attempt + 1 < attempts
                if not retryable:
                    raise from_rpc_error(err, what) from None
                delay_s = min(2.0, 0.1 * 2**attempt) * (0.5 + random.random())
                log.warning("%s: unavailable (%s); retry %d/%d in %.2f s", what, err.details(), attempt + 1,
                            self.max_retries, delay_s)
                time.sleep(delay_s)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_health(addr: str, timeout_s: float, service: str = "") -> None:
    """Block until addr answers grpc.health.v1 SERVING, or raise TimeoutError naming addr."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                last = err.code().name
            time.sleep(0.1)
    raise TimeoutError(f"gRPC server {addr}: not SERVING after {timeout_s} s (last: {last})")
