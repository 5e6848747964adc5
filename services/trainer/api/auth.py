"""The job API's bearer tokens, one check shared by the REST and gRPC front ends: the operator's `api_token` opens
everything; a job's own token (made at submit, kept only as its SHA-256) opens that job's paths of the REST API and
no other job's."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable

from services.common.errors import Unauthenticated

# A job's own paths: its record, events and cancel; its samples (an agent sample's session), checkpoints and log on
# the dashboard; its buffer.
JOB_PATH = re.compile(r"^/v1/(?:jobs|dashboard/jobs|dashboard/buffer)/(?P<job_id>[^/]+)"
                      r"(?:/(?:cancel|events|samples|samples/\d+/session|checkpoints|log))?$")


def check_bearer(authorization: str | None, api_token: str) -> None:
    """Raise Unauthenticated unless `authorization` is "Bearer <api_token>"; no token configured: allow all."""
    if not api_token:
        return
    if not hmac.compare_digest(_given(authorization).encode(), api_token.encode()):
        raise Unauthenticated("job API: missing or wrong bearer token (send `Authorization: Bearer <token>`)")


def check_rest_bearer(authorization: str | None, api_token: str, path: str,
                      job_token_digest: Callable[[str], str]) -> None:
    """The REST API's check of a request for `path`: the operator's token, or the token of the job the path names
    (`job_token_digest(job_id)`: "" for none); no operator token configured: allow all."""
    if not api_token:
        return
    given = _given(authorization)
    if hmac.compare_digest(given.encode(), api_token.encode()):
        return
    match = JOB_PATH.match(path)
    digest = job_token_digest(match["job_id"]) if match and given else ""
    if digest and hmac.compare_digest(token_digest(given), digest):
        return
    raise Unauthenticated("job API: missing or wrong bearer token (send `Authorization: Bearer <token>`: the "
                          "operator's, or a job's own token for that job's paths alone)")


def new_job_token() -> tuple[str, str]:
    """A fresh job token and the digest the registry keeps of it."""
    token = secrets.token_urlsafe(32)
    return token, token_digest(token)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _given(authorization: str | None) -> str:
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""
