"""The job API's bearer token: one check shared by the REST and gRPC front ends."""

from __future__ import annotations

import hmac

from services.common.errors import Unauthenticated


def check_bearer(authorization: str | None, api_token: str) -> None:
    """Raise Unauthenticated unless `authorization` is "Bearer <api_token>"; no token configured: allow all."""
    if not api_token:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_token.encode()):
        raise Unauthenticated("job API: missing or wrong bearer token (send `Authorization: Bearer <token>`)")
