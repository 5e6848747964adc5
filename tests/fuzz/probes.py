"""Send one hostile input over gRPC or HTTP and classify the answer.

clear: refused (or handled) with a status that names the caller's mistake; accepted_unauthenticated: a call without
the right token got past authentication; internal: INTERNAL/UNKNOWN or HTTP 5xx; hang: no answer within the
deadline. Which inputs to send is left to `inputs`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import grpc
import httpx

CLEAR, UNAUTH, INTERNAL, HANG = "clear", "accepted_unauthenticated", "internal", "hang"
OUTCOMES = (CLEAR, UNAUTH, INTERNAL, HANG)
DEADLINE_S = 30.0  # no hostile input may hold a service longer than this
_INTERNAL_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS)


@dataclass
class Tally:
    """Outcomes per input class, and a few examples of each bad outcome for the report."""

    counts: dict[str, collections.Counter] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, input_class: str, outcome: str, what: str) -> None:
        self.counts.setdefault(input_class, collections.Counter())[outcome] += 1
        if outcome != CLEAR and len(self.examples) < 40:
            self.examples.append(f"{input_class}: {outcome}: {what}")

    def total(self, outcome: str | None = None) -> int:
        return sum(c[outcome] if outcome else sum(c.values()) for c in self.counts.values())


def grpc_call(channel: grpc.Channel, method: str, payload: bytes, *, metadata=None, authenticated: bool) -> str:
    """Call `method` ("/physarum.v1.Buffer/GetStats") with raw bytes and classify the answer."""
    call = channel.unary_unary(method)  # bytes in, bytes out: the request goes unparsed by this side
    try:
        call(payload, timeout=DEADLINE_S, metadata=metadata)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HANG
    if not authenticated:
        return CLEAR if code == grpc.StatusCode.UNAUTHENTICATED else UNAUTH
    return INTERNAL if code in _INTERNAL_CODES else CLEAR


def http_call(client: httpx.Client, method: str, url: str, *, authenticated: bool, **kwargs) -> str:
    """An HTTP request classified: 401 is the only clear answer without a token; 5xx is internal."""
    try:
        reply = client.request(method, url, timeout=DEADLINE_S, **kwargs)
    except httpx.TimeoutException:
        return HANG
    except httpx.TransportError:
        return INTERNAL  # the connection died under the request: the service fell over
    if not authenticated:
        return CLEAR if reply.status_code == 401 else UNAUTH
    return INTERNAL if reply.status_code >= 500 else CLEAR
