"""Clients for the SGLang HTTP API of one engine (a real SGLang server or Physarum's CPU engine).

Speaks exactly SGLang's request and response shapes; every call has a timeout.
Admin calls go to each engine directly: the router answers 404 for them. Tolerates SGLang releases: `/model_info` or
the older `/get_model_info` (and `/server_info` or `/get_server_info`); `/begin_weight_update` and
`/end_weight_update` present (0.5.23+, then required) or absent (older releases, then skipped).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from services.common import auth
from services.common.errors import DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from services.common.http_client import HttpClient

DEFAULT_GROUP_NAME = "weight_update_group"
FALLBACKS = {"/model_info": "/get_model_info", "/server_info": "/get_server_info"}  # newer path -> older one


CPU_ENGINE = "physarum-cpu-engine"  # the CPU engine's /server_info `version` starts with it (SGLang's: a release)


def lora_adapter_name(job_id: str) -> str:
    """The name a LoRA job's adapter has on the engines (its requests' lora_path): the job's id."""
    return job_id


def versioned_adapter_name(lora_name: str, version: str) -> str:
    """An adapter's name at one weight version, under lora_sync disk: SGLang cannot replace an adapter in place, so
    each version is loaded under a name of its own and the requests move to it once every engine holds it."""
    return f"{lora_name}@v{version}"


def unversioned_adapter_name(name: str) -> str:
    """The adapter `name` is a version of (versioned_adapter_name's inverse); a name without a version is itself."""
    base, _, version = name.rpartition("@v")
    return base if version.isdigit() else name


def serves_adapter_push(server_info: dict) -> bool:
    """Whether an engine takes an adapter over the weight-update group (/load_lora_adapter_from_distributed): the
    Physarum CPU engine does, SGLang does not."""
    return str(server_info.get("version", "")).startswith(CPU_ENGINE)


def _reply(url: str, path: str, reply: httpx.Response) -> Any:
    """The JSON (or text, or None) of a reply; NotFound on 404, FailedPrecondition on any other error status."""
    if reply.status_code == 404:
        raise NotFound(f"engine {url}: {path} -> HTTP 404: {reply.text[:200]}")
    if reply.status_code >= 400:
        raise FailedPrecondition(f"engine {url}: {path} -> HTTP {reply.status_code}: {reply.text[:500]}")
    if not reply.content:
        return None
    try:
        return reply.json()
    except ValueError:
        return reply.text


def _checked(url: str, path: str, result: Any) -> Any:
    """A weight-update reply: SGLang answers {"success": bool, "message": str}."""
    if isinstance(result, dict) and result.get("success") is False:
        raise FailedPrecondition(f"engine {url}: {path} failed: {result.get('message')}")
    return result


def _transport_error(url: str, path: str, timeout_s: float, err: httpx.TransportError) -> Exception:
    if isinstance(err, httpx.TimeoutException):
        return DeadlineExceeded(f"engine {url}: no {path} reply in {timeout_s} s")
    return Unavailable(f"engine {url}: {path}: {type(err).__name__}: {err}")


def update_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                      backend: str) -> dict:
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def distributed_update_body(names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: str | None,
                            group_name: str, flush_cache: bool = True) -> dict:
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version}


def disk_update_body(model_path: str, weight_version: str | None, abort_all_requests: bool = False) -> dict:
    return {"model_path": model_path, "weight_version": weight_version, "abort_all_requests": abort_all_requests}


class SGLangClient(HttpClient):
    """Synchronous client of one engine URL ("http://127.0.0.1:31001")."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        super().__init__(url, timeout_s, headers=auth.bearer(auth.read_token("engine")))  # admin calls need it
        self.weight_sessions: bool | None = None  # whether /begin_weight_update exists; None until first asked

    def _request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        timeout_s = timeout_s or self.timeout_s
        try:
            reply = self.http.request(method, path, json=body, timeout=timeout_s)
        except httpx.TransportError as err:
            raise _transport_error(self.url, path, timeout_s, err) from err
        return _reply(self.url, path, reply)

    def _get_with_fallback(self, path: str) -> Any:
        try:
            return self._request("GET", path)
        except NotFound:
            return self._request("GET", FALLBACKS[path])

    def _post_checked(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        return _checked(self.url, path, self._request("POST", path, body, timeout_s))

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
        return self._get_with_fallback("/model_info")

    def server_info(self) -> dict:
        return self._get_with_fallback("/server_info")

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
        body = update_group_body(master_address, master_port, rank_offset, world_size, group_name, backend)
        return self._post_checked("/init_weights_update_group", body, timeout_s)

    def _session(self, path: str, body: dict) -> dict | None:
        """/begin_weight_update or /end_weight_update; None on releases without update sessions (404, remembered)."""
        if self.weight_sessions is False:
            return None
        try:
            result = self._post_checked(path, body)
        except NotFound:
            self.weight_sessions = False
            return None
        self.weight_sessions = True
        return result

    def begin_weight_update(self) -> dict | None:
        return self._session("/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> dict | None:
        return self._session("/end_weight_update", {})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: str | None = None, group_name: str = DEFAULT_GROUP_NAME,
                                        flush_cache: bool = True, timeout_s: float | None = None) -> dict:
        body = distributed_update_body(names, dtypes, shapes, weight_version, group_name, flush_cache)
        return self._post_checked("/update_weights_from_distributed", body, timeout_s)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        return self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 abort_all_requests: bool = False, timeout_s: float | None = None) -> dict:
        return self._post_checked("/update_weights_from_disk",
                                  disk_update_body(model_path, weight_version, abort_all_requests), timeout_s)

    def update_weights_delta_from_distributed(self, num_bytes: int, group_name: str = DEFAULT_GROUP_NAME,
                                              timeout_s: float | None = None) -> dict:
        """Physarum's delta push (the CPU engine's): the engine receives one blob over the group and applies it."""
        return self._post_checked("/update_weights_delta_from_distributed",
                                  {"num_bytes": num_bytes, "group_name": group_name}, timeout_s)

    def pull_weights(self, source_dir: str, target_version: str, timeout_s: float | None = None) -> dict:
        """slime's /pull_weights: the engine brings itself to target_version from the deltas in source_dir."""
        return self._post_checked("/pull_weights", {"source_dir": source_dir, "target_version": target_version},
                                  timeout_s)

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout_s: float | None = None) -> dict:
        """SGLang's: load PEFT's adapter directory `lora_path` as `lora_name`."""
        return self._post_checked("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path}, timeout_s)

    def update_weight_version(self, new_version: str, timeout_s: float | None = None) -> dict:
        """SGLang's: the engine reports `new_version` from now on, its weights as they are (abort_all_requests
        false: the requests in flight go on)."""
        return self._post_checked("/update_weight_version", {"new_version": new_version, "abort_all_requests": False},
                                  timeout_s)

    def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> dict:
        return self._post_checked("/unload_lora_adapter", {"lora_name": lora_name}, timeout_s)

    def load_lora_adapter_from_distributed(self, lora_name: str, config: dict, names: list[str], dtypes: list[str],
                                           shapes: list[list[int]], weight_version: str | None = None,
                                           group_name: str = DEFAULT_GROUP_NAME,
                                           timeout_s: float | None = None) -> dict:
        """Physarum's adapter push (the CPU engine's): the engine receives the adapter's tensors over the group, one
        broadcast each in `names`' order, and serves them as `lora_name` (PEFT's `config`)."""
        body = {"lora_name": lora_name, "config": config, "names": names, "dtypes": dtypes, "shapes": shapes,
                "group_name": group_name, "weight_version": weight_version}
        return self._post_checked("/load_lora_adapter_from_distributed", body, timeout_s)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})


class AsyncSGLangClient:
    """The calls a controller of many engines makes (health, version, disk loads, aborts); each call names its engine
    URL and has a timeout. Each engine has an httpx.AsyncClient of its own: httpx's pool looks at every connection it
    keeps on each request, so one client kept alive to 64 engines cost ~5x the CPU per health check."""

    MAX_ENGINES = 1024  # clients kept; past this the least recently used one is closed (engines come and go)

    def __init__(self, timeout_s: float = 30.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.timeout_s = timeout_s
        self.transport = transport
        self.headers = auth.bearer(auth.read_token("engine"))
        self.clients: dict[str, httpx.AsyncClient] = {}  # by engine URL, the most recently used last

    async def _http(self, url: str) -> httpx.AsyncClient:
        client = self.clients.pop(url, None) or httpx.AsyncClient(timeout=self.timeout_s, transport=self.transport,
                                                                   headers=self.headers)
        self.clients[url] = client
        if len(self.clients) > self.MAX_ENGINES:
            await self.clients.pop(next(iter(self.clients))).aclose()
        return client

    async def _request(self, url: str, method: str, path: str, body: dict | None = None,
                       timeout_s: float | None = None) -> Any:
        timeout_s = timeout_s or self.timeout_s
        url = url.rstrip("/")
        try:
            reply = await (await self._http(url)).request(method, url + path, json=body, timeout=timeout_s)
        except httpx.TransportError as err:
            raise _transport_error(url, path, timeout_s, err) from err
        return _reply(url, path, reply)

    async def _get_with_fallback(self, url: str, path: str, timeout_s: float | None = None) -> Any:
        try:
            return await self._request(url, "GET", path, timeout_s=timeout_s)
        except NotFound:
            return await self._request(url, "GET", FALLBACKS[path], timeout_s=timeout_s)

    async def _ok(self, url: str, path: str, timeout_s: float) -> bool:
        try:
            url = url.rstrip("/")
            reply = await (await self._http(url)).get(url + path, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def health(self, url: str, timeout_s: float = 5.0) -> bool:
        return await self._ok(url, "/health", timeout_s)

    async def health_generate(self, url: str, timeout_s: float = 5.0) -> bool:
        return await self._ok(url, "/health_generate", timeout_s)

    async def model_info(self, url: str, timeout_s: float | None = None) -> dict:
        return await self._get_with_fallback(url, "/model_info", timeout_s)

    async def server_info(self, url: str, timeout_s: float | None = None) -> dict:
        return await self._get_with_fallback(url, "/server_info", timeout_s)

    async def weight_version(self, url: str, timeout_s: float | None = None) -> str:
        return str((await self.model_info(url, timeout_s)).get("weight_version", "default"))

    async def abort_request(self, url: str, rid: str = "", abort_all: bool = False,
                            timeout_s: float | None = None) -> None:
        """Abort request `rid`, or every request with abort_all (the body names only the one that applies)."""
        body = {"abort_all": True} if abort_all else {"rid": rid}
        await self._request(url, "POST", "/abort_request", body, timeout_s)

    async def update_weights_from_disk(self, url: str, model_path: str, weight_version: str | None = None,
                                       timeout_s: float | None = None) -> dict:
        result = await self._request(url, "POST", "/update_weights_from_disk",
                                     disk_update_body(model_path, weight_version), timeout_s)
        return _checked(url, "/update_weights_from_disk", result)

    async def update_weight_version(self, url: str, new_version: str, timeout_s: float | None = None) -> dict:
        """SGLang's: the engine reports `new_version`, its weights as they are, the requests in flight going on."""
        result = await self._request(url, "POST", "/update_weight_version",
                                     {"new_version": new_version, "abort_all_requests": False}, timeout_s)
        return _checked(url, "/update_weight_version", result)

    async def load_lora_adapter(self, url: str, lora_name: str, lora_path: str,
                                timeout_s: float | None = None) -> dict:
        """SGLang's: load PEFT's adapter directory `lora_path` as `lora_name`."""
        result = await self._request(url, "POST", "/load_lora_adapter",
                                     {"lora_name": lora_name, "lora_path": lora_path}, timeout_s)
        return _checked(url, "/load_lora_adapter", result)

    async def unload_lora_adapter(self, url: str, lora_name: str, timeout_s: float | None = None) -> dict:
        result = await self._request(url, "POST", "/unload_lora_adapter", {"lora_name": lora_name}, timeout_s)
        return _checked(url, "/unload_lora_adapter", result)

    async def close(self) -> None:
        clients, self.clients = list(self.clients.values()), {}
        await asyncio.gather(*(client.aclose() for client in clients))
