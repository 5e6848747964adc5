"""A client for the SGLang HTTP API of one engine (a real SGLang server or Physarum's CPU engine).

Speaks exactly SGLang's request and response shapes (reference/sglang-protocol.md §3); every call has a timeout.
Admin calls go to each engine directly: the router answers 404 for them.
"""

from __future__ import annotations

from typing import Any

import httpx

from services.common.errors import DeadlineExceeded, FailedPrecondition, Unavailable

DEFAULT_GROUP_NAME = "weight_update_group"


class SGLangClient:
    """Synchronous client of one engine URL ("http://127.0.0.1:31001")."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def _request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        try:
            reply = self.http.request(method, path, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.TimeoutException as err:
            raise DeadlineExceeded(f"engine {self.url}: no {path} reply in {timeout_s or self.timeout_s} s") from err
        except httpx.TransportError as err:
            raise Unavailable(f"engine {self.url}: {path}: {type(err).__name__}: {err}") from err
        if reply.status_code >= 400:
            raise FailedPrecondition(f"engine {self.url}: {path} -> HTTP {reply.status_code}: {reply.text[:500]}")
        if not reply.content:
            return None
        try:
            return reply.json()
        except ValueError:
            return reply.text

    def _checked(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST a weight-update call; SGLang answers {"success": bool, "message": str}."""
        result = self._request("POST", path, body, timeout_s)
        if isinstance(result, dict) and result.get("success") is False:
            raise FailedPrecondition(f"engine {self.url}: {path} failed: {result.get('message')}")
        return result

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return self.http.get("/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self, timeout_s: float = 5.0) -> bool:
        try:
            return self.http.get("/health_generate", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> dict:
        """`/model_info`, falling back to the deprecated `/get_model_info` of older SGLang releases."""
        try:
            return self._request("GET", "/model_info")
        except FailedPrecondition:
            return self._request("GET", "/get_model_info")

    def server_info(self) -> dict:
        return self._request("GET", "/server_info")

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version", "default"))

    def generate(self, payload: dict, timeout_s: float | None = None) -> Any:
        return self._request("POST", "/generate", payload, timeout_s)

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def pause_generation(self, mode: str = "abort") -> None:
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", {})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo",
                                  timeout_s: float | None = None) -> dict:
        return self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout_s)

    def begin_weight_update(self) -> dict | None:
        """Open an update session; older SGLang releases have no such endpoint (404), which is fine."""
        try:
            return self._checked("/begin_weight_update", {"selector": "all"})
        except FailedPrecondition as err:
            if "HTTP 404" in str(err):
                return None
            raise

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: str | None = None, group_name: str = DEFAULT_GROUP_NAME,
                                        flush_cache: bool = True, timeout_s: float | None = None) -> dict:
        return self._checked("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version}, timeout_s)

    def end_weight_update(self) -> dict | None:
        try:
            return self._checked("/end_weight_update", {})
        except FailedPrecondition as err:
            if "HTTP 404" in str(err):
                return None
            raise

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict:
        return self._checked("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
