"""The shared shape of every gRPC client: a channel, a deadline on every call, bounded retries.

Only idempotent calls retry, on UNAVAILABLE, with jittered exponential backoff, at least max_retries times and until
retry_window_s has passed (a restarting peer comes back within it); each retry is logged.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from services.common import auth
from services.common.errors import from_rpc_error

log = logging.getLogger(__name__)

RETRY_WINDOW_S = 30.0  # a restarted buffer or rollout manager (or Redis behind the buffer) serves again within it
MAX_BACKOFF_S = 2.0
# A channel that failed to connect waits before it tries again (gRPC's default backoff grows to 120 s): capped, so a
# peer that restarted on its port is reached within a couple of seconds.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


class GrpcClient:
    """Base of the service clients; a context manager that closes its channel."""

    service = "service"

    def __init__(self, addr: str, timeout_s: float = 10.0, max_retries: int = 3,
                 retry_window_s: float = RETRY_WINDOW_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.addr = addr
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_window_s = retry_window_s
        self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        # sent with every call: the callee's bearer token, when this process was given one (services.common.auth)
        token = auth.read_token(self.service) if self.service in auth.SERVICES else ""
        self.metadata: tuple[tuple[str, str], ...] | None = tuple(auth.bearer(token).items()) or None

    def call(self, method: Callable, request: Any, *, timeout_s: float | None = None,
             idempotent: bool = False) -> Any:
        name = getattr(method, "_method", b"").decode() if hasattr(method, "_method") else str(method)
        what = f"{self.service} {self.addr} {name.rsplit('/', 1)[-1]}"
        give_up_at, attempt = None, 0
        while True:
            try:
                return method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                delay_s = min(MAX_BACKOFF_S, 0.1 * 2**attempt) * (0.5 + random.random())
                attempt += 1
                give_up_at = give_up_at or time.monotonic() + self.retry_window_s  # from the first failure
                retryable = idempotent and err.code() == grpc.StatusCode.UNAVAILABLE and (
                    attempt <= self.max_retries or time.monotonic() + delay_s < give_up_at)
                if not retryable:
                    raise from_rpc_error(err, what) from None
                log.warning("%s: unavailable (%s); retry %d in %.2f s (for up to %.0f s)",
                            what, err.details(), attempt, delay_s, self.retry_window_s)
                time.sleep(delay_s)

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
