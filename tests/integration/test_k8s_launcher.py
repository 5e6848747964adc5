"""KubernetesEngineLauncher against kmock over real HTTP: the exact /scale PATCH, pods listed and watched by label,
404/409/500 and connection errors retried with backoff, and a timeout on every watch.

kmock 0.8 serves the Kubernetes API in memory on 127.0.0.1; it runs on its own event loop in a thread because the
official client is synchronous. Its caveats, handled here: it ignores ?labelSelector= (patched below) and
?timeoutSeconds= (the launcher's read timeout ends the watch), and only changes made over HTTP emit watch events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time

import kmock
import pytest
from kubernetes import client

from services.common import procs
from services.common.errors import FailedPrecondition, Unavailable
from services.rollout.pool.k8s import EngineEvent, KubernetesEngineLauncher
from services.rollout.pool.launchers import KubernetesLauncher

DEPLOY, PODS = kmock.resource("apps", "v1", "deployments"), kmock.resource("", "v1", "pods")
NS, NAME, SELECTOR = "rl", "demo-engine", "app.kubernetes.io/component=engine,app.kubernetes.io/instance=demo"
LABELS = {"app.kubernetes.io/component": "engine", "app.kubernetes.io/instance": "demo"}
ENGINE_CONTAINER = {"name": "engine", "image": "physarum/engine:0.1.0"}
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}/scale"


def selector_matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`, comma-separated (all must hold)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key) == value
        else:
            ok = (term[1:] not in labels) if term.startswith("!") else term in labels
        if not ok:
            return False
    return True


class SelectorAwareEmulator(kmock.KubernetesEmulator):
    """kmock 0.8 ignores ?labelSelector= on LIST and WATCH: filter in its name-mangled check (private 0.x API)."""

    def _KubernetesEmulator__check(self, request, resource, namespace, name, strict):  # noqa: N802
        if not kmock.KubernetesEmulator._KubernetesEmulator__check(self, request, resource, namespace, name, strict):
            return False
        selector = (request.params or {}).get("labelSelector")
        labels = (self._objects[resource, namespace, name].last.raw.get("metadata") or {}).get("labels") or {}
        return not selector or selector_matches(labels, selector)


class KMockThread:
    """kmock's emulator and HTTP server on an event loop in a daemon thread; `call` runs code on that loop."""

    def __enter__(self) -> KMockThread:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve() -> None:
            self.stopping = asyncio.Event()
            async with SelectorAwareEmulator() as emulator, kmock.Server(emulator) as server:
                self.emulator, self.url = emulator, str(server.url).rstrip("/")
                started.set()
                await self.stopping.wait()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        assert started.wait(10), "kmock did not start in 10 s"
        return self

    def call(self, fn, *args):
        """fn(*args) on the server's loop (kmock's state is not thread-safe)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def requests(self) -> list:
        return self.call(lambda: list(self.emulator))

    def fail(self, view_filter: tuple, statuses: list[int]) -> None:
        """The next len(statuses) requests matching view_filter get these HTTP statuses, one each, in order."""
        def inject():
            view = self.emulator[view_filter]
            for i, status in enumerate(statuses):
                view[i:i + 1] << status << {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                            "code": status, "message": f"injected {status}"}
        self.call(inject)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture()
def k8s():
    with KMockThread() as server:
        yield server


@pytest.fixture()
def api(k8s):
    """The test's own client: it plays kubelet and ReplicaSet, over HTTP so that watches see the changes."""
    with client.ApiClient(client.Configuration(host=k8s.url)) as api_client:
        yield client.CoreV1Api(api_client), client.AppsV1Api(api_client)


def make_launcher(url: str, **overrides) -> KubernetesEngineLauncher:
    options = dict(namespace=NS, deployment=NAME, label_selector=SELECTOR, engine_port=30000,
                   configuration=client.Configuration(host=url), request_timeout_s=1.0, watch_timeout_s=1,
                   max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05)
    return KubernetesEngineLauncher(**{**options, **overrides})


@pytest.fixture()
def launcher(k8s):
    with make_launcher(k8s.url) as engines:
        yield engines


def create_deployment(api, replicas: int = 1) -> None:
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": NS},
            "spec": {"replicas": replicas, "selector": {"matchLabels": LABELS},
                     "template": {"metadata": {"labels": LABELS}, "spec": {"containers": [ENGINE_CONTAINER]}}}}
    api[1].create_namespaced_deployment(NS, body, _request_timeout=5)


def create_pod(api, name: str, labels: dict[str, str] | None = None, ip: str | None = None) -> None:
    """A pod; with `ip` it is Running and Ready at that IP, without one it is Pending."""
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels or LABELS},
            "spec": {"containers": [ENGINE_CONTAINER]}, "status": pod_status(ip)}
    api[0].create_namespaced_pod(NS, body, _request_timeout=5)


def pod_status(ip: str | None) -> dict:
    if ip is None:
        return {"phase": "Pending"}
    return {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}


def set_pod_status(api, name: str, ip: str | None) -> None:
    api[0].patch_namespaced_pod_status(name, NS, {"status": pod_status(ip)}, _request_timeout=5)


def only(requests, method: str, path: str) -> list:
    return [r for r in requests if r.method.value.upper() == method and r.url.path == path]


def test_scale_sends_exactly_one_merge_patch_to_the_scale_subresource(k8s, api, launcher):
    create_deployment(api, replicas=1)
    launcher.scale(4)
    (patch,) = only(k8s.requests(), "PATCH", SCALE_PATH)
    assert patch.headers["Content-Type"] == "application/merge-patch+json"
    assert json.loads(patch.body) == {"spec": {"replicas": 4}}
    assert patch.params == {}
    assert launcher.desired_replicas() == 4
    assert [r.url.path for r in only(k8s.requests(), "GET", SCALE_PATH)] == [SCALE_PATH]
    with pytest.raises(ValueError, match="replicas must be >= 0, got -1"):
        launcher.scale(-1)


def test_engine_urls_lists_pods_by_label_and_keeps_only_ready_ones(k8s, api, launcher):
    create_pod(api, "demo-engine-a", ip="10.0.0.5")
    create_pod(api, "demo-engine-b")  # Pending: no engine yet
    create_pod(api, "demo-engine-v6", ip="fd00::7")
    create_pod(api, "trainer-0", labels={"app.kubernetes.io/component": "trainer"}, ip="10.0.0.9")
    assert launcher.engine_urls() == ["http://10.0.0.5:30000", "http://[fd00::7]:30000"]
    (listing,) = only(k8s.requests(), "GET", f"/api/v1/namespaces/{NS}/pods")
    assert listing.params == {"labelSelector": SELECTOR}


def test_watch_reports_ready_and_gone_engines_by_label_and_ends_on_its_timeout(k8s, api, launcher):
    create_pod(api, "demo-engine-a", ip="10.0.0.5")
    create_pod(api, "demo-engine-b")
    events: list[EngineEvent] = []
    started = time.monotonic()
    watcher = threading.Thread(target=lambda: events.extend(launcher.watch(timeout_s=2)))
    watcher.start()
    deadline = time.monotonic() + 5
    while not any(r.params.get("watch") == "true" for r in k8s.requests()) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # the watch stream is open: changes from here on arrive as events
    set_pod_status(api, "demo-engine-b", "10.0.0.6")  # kubelet: b is ready
    create_pod(api, "trainer-0", labels={"app.kubernetes.io/component": "trainer"}, ip="10.0.0.9")
    api[0].delete_namespaced_pod("demo-engine-a", NS, _request_timeout=5)
    watcher.join(10)
    elapsed = time.monotonic() - started
    assert not watcher.is_alive()
    assert events == [EngineEvent("ready", "demo-engine-a", "http://10.0.0.5:30000"),
                      EngineEvent("ready", "demo-engine-b", "http://10.0.0.6:30000"),
                      EngineEvent("gone", "demo-engine-a", "http://10.0.0.5:30000")]
    assert launcher.ready == {"demo-engine-b": "http://10.0.0.6:30000"}
    # kmock ignores timeoutSeconds, so the launcher's read timeout (timeout + request timeout) ended the window
    assert 2.0 <= elapsed < 2 + 1.0 + 2.0
    (watch,) = [r for r in k8s.requests() if r.params.get("watch") == "true"]
    assert watch.url.path == f"/api/v1/namespaces/{NS}/pods"
    assert watch.params["labelSelector"] == SELECTOR and watch.params["timeoutSeconds"] == "2"


def test_every_watch_has_a_timeout_and_a_new_watch_catches_up_by_listing(k8s, api, launcher):
    create_pod(api, "demo-engine-a", ip="10.0.0.5")
    assert list(launcher.watch()) == [EngineEvent("ready", "demo-engine-a", "http://10.0.0.5:30000")]
    set_pod_status(api, "demo-engine-a", None)  # not ready any more, while nobody watched
    assert list(launcher.watch()) == [EngineEvent("gone", "demo-engine-a", "http://10.0.0.5:30000")]
    watches = [r for r in k8s.requests() if r.params.get("watch") == "true"]
    assert len(watches) == 2
    assert all(r.params["timeoutSeconds"] == "1" and r.params["labelSelector"] == SELECTOR for r in watches)


@pytest.mark.parametrize("status", [404, 409, 500])
def test_scale_retries_failed_patches_with_backoff_then_succeeds(k8s, api, launcher, caplog, status):
    create_deployment(api)
    k8s.fail((kmock.method.PATCH, kmock.subresource("scale")), [status, status])
    with caplog.at_level(logging.WARNING, logger="services.rollout.pool.k8s"):
        launcher.scale(3)
    patches = only(k8s.requests(), "PATCH", SCALE_PATH)
    assert len(patches) == 3 and all(json.loads(p.body) == {"spec": {"replicas": 3}} for p in patches)
    retries = [r.getMessage() for r in caplog.records]
    assert len(retries) == 2
    assert all(f"HTTP {status}" in m and f"injected {status}" in m and SCALE_PATH in m for m in retries)
    assert "retry 1/3 in" in retries[0] and "retry 2/3 in" in retries[1]
    assert launcher.desired_replicas() == 3


def test_list_and_watch_retry_server_errors_too(k8s, api, launcher):
    create_pod(api, "demo-engine-a", ip="10.0.0.5")
    k8s.fail((kmock.action.LIST, PODS), [500])
    k8s.fail((kmock.action.WATCH, PODS), [409, 404])
    assert list(launcher.watch()) == [EngineEvent("ready", "demo-engine-a", "http://10.0.0.5:30000")]
    pods_requests = only(k8s.requests(), "GET", f"/api/v1/namespaces/{NS}/pods")
    assert [r.params.get("watch") for r in pods_requests] == [None, None, "true", "true", "true"]


def test_gives_up_after_max_attempts_with_a_clear_error(k8s, api, launcher):
    create_deployment(api)
    k8s.fail((kmock.method.PATCH, kmock.subresource("scale")), [500] * 10)
    started = time.monotonic()
    with pytest.raises(Unavailable, match=rf"kubernetes PATCH {SCALE_PATH}: gave up after 4 attempts; "
                                          r"last error: HTTP 500 Internal Server Error: injected 500"):
        launcher.scale(2)
    assert len(only(k8s.requests(), "PATCH", SCALE_PATH)) == 4
    assert time.monotonic() - started < 1.0  # 3 delays of at most backoff_max_s


def test_a_hung_api_server_hits_the_request_timeout(k8s, caplog):
    async def hang():
        await asyncio.sleep(3)
        return {"items": []}

    k8s.call(lambda: k8s.emulator[kmock.action.LIST, PODS] << hang)
    started = time.monotonic()
    with make_launcher(k8s.url, request_timeout_s=0.5, max_attempts=2) as engines:
        with pytest.raises(Unavailable, match="gave up after 2 attempts; last error: .*timed out"):
            engines.engine_urls()
    assert time.monotonic() - started < 2.0


def test_other_statuses_fail_at_once(k8s, api, launcher):
    create_deployment(api)
    k8s.fail((kmock.method.PATCH, kmock.subresource("scale")), [403])
    with pytest.raises(FailedPrecondition, match=r"PATCH .*/scale: HTTP 403 Forbidden: injected 403"):
        launcher.scale(2)
    assert len(only(k8s.requests(), "PATCH", SCALE_PATH)) == 1


def test_connection_errors_are_retried_then_reported(caplog):
    url = f"http://127.0.0.1:{procs.free_port()}"  # nothing listens there
    with make_launcher(url, max_attempts=3) as engines, caplog.at_level(logging.WARNING, "services.rollout.pool.k8s"):
        with pytest.raises(Unavailable, match=r"kubernetes GET /api/v1/namespaces/rl/pods\?labelSelector=.*: "
                                              r"gave up after 3 attempts; last error: MaxRetryError"):
            engines.engine_urls()
    assert len(caplog.records) == 2 and all("NewConnectionError" in r.getMessage() for r in caplog.records)


def test_the_launcher_does_not_import_torch():
    code = "import sys, services.rollout.pool.k8s; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_engine_options_patch_the_engine_containers_args(k8s, api, launcher):
    """A job's --sglang-* flags: one strategic merge patch of the pod template, each flag given replacing its old
    value (Kubernetes then rolls the pods)."""
    create_deployment(api, replicas=1)
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
    api[1].patch_namespaced_deployment(NAME, NS, {"spec": {"template": {"spec": {"containers": [
        {**ENGINE_CONTAINER, "args": ["--model-path=/m", "--mem-fraction-static=0.8", "--enable-metrics"]}]}}}},
        _request_timeout=5)
    KubernetesLauncher(launcher).set_engine_options({"sglang_mem_fraction_static": 0.7, "sglang_dtype": "bfloat16"})
    patch = only(k8s.requests(), "PATCH", path)[-1]
    assert patch.headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert json.loads(patch.body) == {"spec": {"template": {"spec": {"containers": [{"name": "engine", "args": [
        "--model-path=/m", "--enable-metrics", "--mem-fraction-static", "0.7", "--dtype", "bfloat16"]}]}}}}
