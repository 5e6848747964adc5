"""The shared shape of the HTTP clients (SGLang engines, the router, the REST job API): a base URL, a default
timeout on every call, and a context manager that closes the connection pool."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every client of this process: building one (loading the CA bundle) takes tens of ms,
    which a client per engine paid at every weight-group rebuild."""
    return httpx.create_ssl_context()


class HttpClient:
    def __init__(self, url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers or {}, verify=_ssl_context())

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
