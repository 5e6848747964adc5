"""Engines as Kubernetes pods: scale the engine Deployment through its /scale subresource and turn its ready pods
into engine URLs (pod IP + engine port) for the router. How many engines to run is the pool's decision, not this.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({404, 409, 429, 500, 502, 503, 504})  # plus connection errors (status 0)
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class EngineEvent:
    """An engine pod became ready (`kind="ready"`), or stopped being ready or went away (`kind="gone"`)."""

    kind: str
    pod: str
    url: str


def pod_engine_url(pod: dict[str, Any], port: int) -> str | None:
    """`http://<pod IP>:<port>` of a pod that is Running, Ready and not terminating; None for any other pod."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []):
        return None
    ip = status.get("podIP")
    if not ip:
        return None
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def backoff_s(attempt: int, base_s: float, max_s: float, rand: Callable[[], float] = random.random) -> float:
    """Delay before retry `attempt` (1-based): exponential, capped at `max_s`, jittered into [cap/2, cap]."""
    cap = min(max_s, base_s * 2 ** (attempt - 1))
    return cap / 2 + rand() * cap / 2


def merge_args(current: list[str], extra: list[str]) -> list[str]:
    """`current` without the flags `extra` sets (as `--flag value...` or `--flag=value`), then `extra`."""
    flags = {token for token in extra if token.startswith("--")}
    out, dropping = [], False
    for token in current:
        if token.startswith("--"):
            dropping = token.split("=", 1)[0] in flags
        if not dropping:
            out.append(token)
    return out + extra


def default_configuration() -> client.Configuration:
    """The service account's configuration inside a pod; ~/.kube/config (or $KUBECONFIG) outside one."""
    configuration = client.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException:
        kube_config.load_kube_config(client_configuration=configuration)
    return configuration


class KubernetesEngineLauncher:
    """The engine Deployment `namespace/deployment`, whose pods carry `label_selector`; engines listen on `engine_port`.

    Every call has a request timeout and every watch a server-side `timeoutSeconds` plus a read timeout; 404, 409,
    429, 5xx and connection errors are retried with jittered exponential backoff, at most `max_attempts` tries.
    Events are relative to the last `engine_urls()` or `watch()` (not thread-safe: one caller at a time).
    """

    def __init__(self, *, namespace: str, deployment: str, label_selector: str, engine_port: int = 30000,
                 configuration: client.Configuration | None = None, request_timeout_s: float = 10.0,
                 watch_timeout_s: int = 60, max_attempts: int = 5, backoff_base_s: float = 0.5,
                 backoff_max_s: float = 8.0) -> None:
        if not label_selector:
            raise InvalidArgument("label_selector must not be empty: it tells the engine pods from every other pod")
        if max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be >= 1, got {max_attempts}")
        if request_timeout_s <= 0 or watch_timeout_s < 1:
            raise InvalidArgument(f"request_timeout_s must be > 0 and watch_timeout_s >= 1, "
                                  f"got {request_timeout_s} and {watch_timeout_s}")
        self.namespace = namespace
        self.deployment = deployment
        self.label_selector = label_selector
        self.engine_port = engine_port
        self.request_timeout_s = request_timeout_s
        self.watch_timeout_s = watch_timeout_s
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        configuration = copy.deepcopy(configuration or default_configuration())
        configuration.retries = 0  # urllib3 must not retry behind our back: retries are ours, bounded and logged
        self.api = client.ApiClient(configuration)
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.ready: dict[str, str] = {}  # pod name -> engine URL, as of the last listing or watch event
        self._scale_path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"
        self._pods_path = f"/api/v1/namespaces/{namespace}/pods?labelSelector={label_selector}"

    def scale(self, replicas: int) -> None:
        """Set the Deployment's desired replicas: PATCH .../scale with the merge patch {"spec": {"replicas": N}}."""
        if replicas < 0:
            raise InvalidArgument(f"replicas must be >= 0, got {replicas}")
        self._json(f"PATCH {self._scale_path}", self.apps.patch_namespaced_deployment_scale, self.deployment,
                   self.namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH)
        log.info("deployment %s/%s scaled to %d engines", self.namespace, self.deployment, replicas)

    def set_engine_args(self, extra: list[str], container: str = "engine") -> None:
        """Set server arguments on the Deployment's engine container (each flag given replaces the one there), a
        strategic merge patch of its pod template: Kubernetes then replaces the pods by a rolling update."""
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployment}"
        deployment = self._json(f"GET {path}", self.apps.read_namespaced_deployment, self.deployment, self.namespace)
        containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
        current = next((c.get("args") or [] for c in containers if c.get("name") == container), None)
        if current is None:
            raise FailedPrecondition(f"deployment {self.namespace}/{self.deployment} has no container {container!r} "
                                     f"to set engine arguments on")
        patch = {"spec": {"template": {"spec": {"containers": [{"name": container,
                                                                 "args": merge_args(current, extra)}]}}}}
        self._json(f"PATCH {path}", self.apps.patch_namespaced_deployment, self.deployment, self.namespace, patch,
                   _content_type=STRATEGIC_MERGE_PATCH)
        log.info("deployment %s/%s: engine arguments %s set (rolling update)", self.namespace, self.deployment,
                 " ".join(extra))

    def desired_replicas(self) -> int:
        """spec.replicas of the Deployment's /scale subresource."""
        scale = self._json(f"GET {self._scale_path}", self.apps.read_namespaced_deployment_scale, self.deployment,
                           self.namespace)
        return int((scale.get("spec") or {}).get("replicas") or 0)

    def engine_urls(self) -> list[str]:
        """URLs of the engine pods that are ready now (one labelSelector list), sorted."""
        self._diff(self._list_pods().get("items") or [])
        return sorted(self.ready.values())

    def watch(self, timeout_s: int | None = None) -> Iterator[EngineEvent]:
        """Engines that became ready or gone since the last call, then as they change, for about `timeout_s`.

        One list (to catch up), then one watch from its resourceVersion; the watch ends after timeoutSeconds on
        the server, or after the read timeout if the server keeps it open; call again to go on watching.
        """
        timeout_s = int(timeout_s or self.watch_timeout_s)
        listing = self._list_pods()
        yield from self._diff(listing.get("items") or [])
        since = (listing.get("metadata") or {}).get("resourceVersion")
        stream = self._call(f"GET {self._pods_path}&watch=true", self.core.list_namespaced_pod, self.namespace,
                            label_selector=self.label_selector, watch=True, timeout_seconds=timeout_s,
                            allow_watch_bookmarks=True, **({"resource_version": since} if since else {}),
                            request_timeout=(self.request_timeout_s, timeout_s + self.request_timeout_s))
        try:
            for line in iter_resp_lines(stream):
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    log.warning("watch of pods %s ended by the server: %s", self.label_selector,
                                (event.get("object") or {}).get("message", event))
                    return
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    yield from self._apply(event["type"], event["object"])
        except urllib3.exceptions.ReadTimeoutError:
            log.debug("watch of pods %s: no event in %d s, the window ends", self.label_selector, timeout_s)
        except urllib3.exceptions.HTTPError as err:
            log.warning("watch of pods %s broke off: %s: %s", self.label_selector, type(err).__name__, err)
        finally:
            stream.close()  # never hand a half-read stream back to the pool
            stream.release_conn()

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> KubernetesEngineLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _list_pods(self) -> dict[str, Any]:
        return self._json(f"GET {self._pods_path}", self.core.list_namespaced_pod, self.namespace,
                          label_selector=self.label_selector)

    def _diff(self, pods: list[dict[str, Any]]) -> list[EngineEvent]:
        now = {pod["metadata"]["name"]: url for pod in pods if (url := pod_engine_url(pod, self.engine_port))}
        events = [EngineEvent("gone", name, url) for name, url in self.ready.items() if now.get(name) != url]
        events += [EngineEvent("ready", name, url) for name, url in now.items() if self.ready.get(name) != url]
        self.ready = now
        return events

    def _apply(self, kind: str, pod: dict[str, Any]) -> list[EngineEvent]:
        name = pod["metadata"]["name"]
        old, new = self.ready.get(name), None if kind == "DELETED" else pod_engine_url(pod, self.engine_port)
        if old == new:
            return []
        events = [EngineEvent("gone", name, old)] if old else []
        if new:
            self.ready[name] = new
            events.append(EngineEvent("ready", name, new))
        else:
            del self.ready[name]
        return events

    def _json(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        reply = self._call(what, fn, *args, **kwargs)
        try:
            return json.loads(reply.data)
        finally:
            reply.release_conn()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, request_timeout: Any = None,
              **kwargs: Any) -> urllib3.BaseHTTPResponse:
        """fn(*args, **kwargs) as a raw reply (not yet read), with a request timeout and bounded, logged retries."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn(*args, **kwargs, _request_timeout=request_timeout or self.request_timeout_s,
                          _preload_content=False)
            except ApiException as err:
                if err.status and err.status not in RETRY_STATUSES:
                    raise FailedPrecondition(f"kubernetes {what}: {_describe(err)}") from err
                cause = _describe(err)
            except urllib3.exceptions.HTTPError as err:
                cause = f"{type(err).__name__}: {err}"
            if attempt == self.max_attempts:
                raise Unavailable(f"kubernetes {what}: gave up after {attempt} attempts; last error: {cause}")
            delay = backoff_s(attempt, self.backoff_base_s, self.backoff_max_s)
            log.warning("kubernetes %s: %s; retry %d/%d in %.2f s", what, cause, attempt, self.max_attempts - 1,
                        delay)
            time.sleep(delay)
        raise AssertionError("unreachable")


def _describe(err: ApiException) -> str:
    """'HTTP 409 Conflict: <the Status message>' from an ApiException."""
    message = ""
    try:
        message = json.loads(err.body or b"{}").get("message", "")
    except (ValueError, AttributeError):
        message = str(err.body or "")[:300]
    return f"HTTP {err.status} {err.reason}" + (f": {message}" if message else "")
