"""Physarum's error types, raised by domain code and mapped to gRPC status codes at the edge, once.

Servers map them in `grpc_server.handle_errors`; clients turn status codes back into them here.
"""

from __future__ import annotations

import grpc


class PhysarumError(Exception):
    """Base of every error a service reports on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(PhysarumError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PhysarumError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(PhysarumError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(PhysarumError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PhysarumError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(PhysarumError, PermissionError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[PhysarumError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, FailedPrecondition, Unavailable, DeadlineExceeded,
                               Unauthenticated)
}


def from_rpc_error(err: grpc.RpcError, what: str) -> PhysarumError:
    """The Physarum error for a failed call; `what` names the call ("buffer 127.0.0.1:5000 GetBatch")."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, PhysarumError)
    return cls(f"{what}: {details}")
