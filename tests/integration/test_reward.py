"""The Reward service over gRPC and REST: in-process servers on free ports, and `python -m services.reward`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.common import procs
from services.common.errors import InvalidArgument
from services.common.grpc_client import wait_for_health
from services.common.samples import Sample
from services.reward.client import RewardClient, ScoreResult
from services.reward.config import RewardConfig
from services.reward.server import create_server

PLUGINS = "tests.plugins.reward_fns"
BATCH = [(r"\boxed{46}", "46"), (r"so \boxed{\frac{1}{2}}", "0.5"), ("the sum is 45", "46"), ("no idea", "7")]


@pytest.fixture(scope="module")
def server():
    """The gRPC and REST servers in-process, on a loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = RewardConfig(port=0, rest_port=0, default_timeout_s=5.0, worker_memory_bytes=2 << 30)
    srv = asyncio.run_coroutine_threadsafe(create_server(config), loop).result(timeout=30)
    yield srv
    asyncio.run_coroutine_threadsafe(srv.stop(1.0), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


@pytest.fixture(scope="module")
def client(server):
    with RewardClient(f"127.0.0.1:{server.grpc.port}", timeout_s=10.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.rest.port}", timeout=30.0) as c:
        yield c


def test_grpc_and_rest_score_a_batch_equally(client, http):
    samples = [Sample(response=r, label=lbl) for r, lbl in BATCH]
    via_grpc = client.score(samples, rm_type="math")
    assert [r.reward for r in via_grpc] == [1.0, 1.0, 0.0, 0.0] and all(r.ok for r in via_grpc)
    reply = http.post("/v1/score", json={"rm_type": "math", "samples": [{"response": r, "label": lbl}
                                                                        for r, lbl in BATCH]})
    assert reply.status_code == 200, reply.text
    assert [ScoreResult(**s) for s in reply.json()["scores"]] == via_grpc


def test_user_function_with_args_and_dict_scores_over_both_apis(client, http):
    samples = [Sample(response="46", label="46", metadata={"bonus": 3}),
               Sample(response="4", label="46", metadata={"bonus": 1})]
    expected = [ScoreResult(5.0, True), ScoreResult(3.0, True)]   # ints survive protobuf's Struct as ints
    assert client.score(samples, custom_rm_path=f"{PLUGINS}.args_echo", args={"n": 2}) == expected
    body = {"custom_rm_path": f"{PLUGINS}.args_echo", "args": {"n": 2},
            "samples": [{"response": s.response, "label": s.label, "metadata": s.metadata} for s in samples]}
    assert [ScoreResult(**s) for s in http.post("/v1/score", json=body).json()["scores"]] == expected
    dicts = client.score(samples, custom_rm_path=f"{PLUGINS}.dapo_like", reward_key="score")
    assert dicts == [ScoreResult(1.0, True, "", {"score": 1.0, "acc": 1.0}),
                     ScoreResult(-1.0, True, "", {"score": -1.0, "acc": 0.0})]


def test_service_keeps_serving_after_failing_and_slow_functions(client, http):
    [boom] = client.score([Sample(response="x")], custom_rm_path=f"{PLUGINS}.boom")
    assert boom == ScoreResult(0.0, False, f"custom_rm_path {PLUGINS}.boom: ValueError: cannot score 'x'")
    [slow] = client.score([Sample()], custom_rm_path=f"{PLUGINS}.slow", timeout_s=0.3, args={"sleep_s": 30})
    assert slow == ScoreResult(0.0, False, "timed out after 0.3 s (worker killed)")
    reply = http.post("/v1/score", json={"custom_rm_path": f"{PLUGINS}.slow", "timeout_s": 0.3,
                                         "args": {"sleep_s": 30}, "samples": [{}]})
    assert reply.json()["scores"] == [{"reward": 0.0, "ok": False, "error": "timed out after 0.3 s (worker killed)",
                                       "scores": {}}]
    assert [r.reward for r in client.score([Sample(response="46", label="46")], rm_type="exact_match")] == [1.0]
    assert http.get("/healthz").json() == {"status": "ok"}


@pytest.mark.parametrize("function, args, error", [
    ("exits", {}, f"custom_rm_path {PLUGINS}.exits: SystemExit: 3"),
    ("interrupts", {}, f"custom_rm_path {PLUGINS}.interrupts: KeyboardInterrupt: "),
    ("dies", {}, f"custom_rm_path {PLUGINS}.dies: worker exited (code 7) while scoring"),
    ("hog_memory", {"num_bytes": 64 << 30}, f"custom_rm_path {PLUGINS}.hog_memory: MemoryError: "),
])
def test_user_code_that_exits_dies_or_hogs_memory_fails_only_its_sample(client, function, args, error):
    [result] = client.score([Sample()], custom_rm_path=f"{PLUGINS}.{function}", args=args)
    assert result == ScoreResult(0.0, False, error)
    assert [r.reward for r in client.score([Sample(response="46", label="46")], rm_type="exact_match")] == [1.0]


def test_blocking_functions_and_huge_responses_are_stopped_while_health_answers(client, http):
    slow = {"custom_rm_path": f"{PLUGINS}.blocking_sleep", "timeout_s": 2.0, "args": {"sleep_s": 600},
            "samples": [{}, {}]}
    huge = {"rm_type": "math", "timeout_s": 2.0, "samples": [{"response": "1+" * (5 << 20), "label": "3"}]}
    with httpx.Client(base_url=str(http.base_url), timeout=120.0) as other:
        with ThreadPoolExecutor(2) as calls:
            blocked = calls.submit(other.post, "/v1/score", json=slow)
            math_scored = calls.submit(other.post, "/v1/score", json=huge)
            for _ in range(5):  # health answers while both run
                assert http.get("/healthz", timeout=60.0).json() == {"status": "ok"}
            blocked_scores, math_scores = blocked.result().json()["scores"], math_scored.result().json()["scores"]
    expected = {"reward": 0.0, "ok": False, "error": "timed out after 2 s (worker killed)", "scores": {}}
    assert blocked_scores == [expected, expected]
    # the math scorer on 10 MB either finishes within its 2 s or is stopped then: never longer, never INTERNAL
    assert math_scores in ([expected], [{"reward": 0.0, "ok": True, "error": "", "scores": {}}]), math_scores
    [error] = client.score([Sample()], custom_rm_path=f"{PLUGINS}.huge_error")
    assert not error.ok and len(error.error) == 2000 and error.error.startswith(f"custom_rm_path {PLUGINS}")


def test_grpc_deadline_covers_the_per_sample_timeout(server):
    with RewardClient(f"127.0.0.1:{server.grpc.port}", timeout_s=0.5) as short:
        results = short.score([Sample()], custom_rm_path=f"{PLUGINS}.slow", timeout_s=3.0, args={"sleep_s": 1.0})
    assert results == [ScoreResult(1.0, True)]


def test_bad_requests_are_rejected_with_the_reason(client, http):
    with pytest.raises(InvalidArgument, match="unknown rm_type 'maths'; expected one of math, deepscaler"):
        client.score([Sample()], rm_type="maths")
    with pytest.raises(InvalidArgument, match=r"custom_rm_path: cannot import module 'tests.plugins.nope'"):
        client.score([Sample()], custom_rm_path="tests.plugins.nope.reward")
    reply = http.post("/v1/score", json={"rm_type": "maths", "samples": [{}]})
    assert reply.status_code == 400 and "unknown rm_type 'maths'" in reply.json()["detail"]
    reply = http.post("/v1/score", json={"rm_type": "math", "samples": [{"respons": "46"}]})
    assert reply.status_code == 422 and "respons" in reply.text
    reply = http.post("/v1/score", json={"rm_type": "math", "timeout_s": -1, "samples": []})
    assert reply.status_code == 422 and "timeout_s" in reply.text
    assert http.get("/docs").status_code == 200 and "/v1/score" in http.get("/openapi.json").json()["paths"]


def test_main_serves_until_sigterm(tmp_path):
    port, rest_port = procs.free_port(), procs.free_port()
    proc = procs.ManagedProcess("reward", procs.python_module("services.reward", "--port", str(port),
                                                              "--rest-port", str(rest_port)),
                                tmp_path / "reward.log").start()

    def healthy() -> bool:
        try:
            wait_for_health(f"127.0.0.1:{port}", timeout_s=0.5)
            return True
        except TimeoutError:
            return False

    try:
        proc.wait_ready(healthy, timeout_s=30)
        with RewardClient(f"127.0.0.1:{port}") as c:
            assert [r.reward for r in c.score([Sample(response=r"\boxed{46}", label="46")])] == [1.0]
        assert httpx.get(f"http://127.0.0.1:{rest_port}/healthz", timeout=5).status_code == 200
    finally:
        assert proc.stop(grace_s=15) == 0, proc.log_tail()


def test_importing_the_service_imports_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "services.reward", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    modules = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import")}
    assert "services.reward.server" in modules and "sympy" in modules
    assert not {m for m in modules if m.split(".")[0] == "torch"}


def scraped(http) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    reply = http.get("/metrics")
    assert reply.status_code == 200
    return {f"{s.name}{dict(sorted(s.labels.items()))}": s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def test_metrics_count_samples_latency_and_errors_by_type(client, http):
    before = scraped(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    client.score([Sample(response="46", label="46"), Sample(response="1", label="2")], rm_type="exact_match")
    client.score([Sample(response="x")], custom_rm_path=f"{PLUGINS}.boom")
    client.score([Sample()], custom_rm_path=f"{PLUGINS}.slow", timeout_s=0.2, args={"sleep_s": 30})
    with pytest.raises(InvalidArgument):
        client.score([Sample()], rm_type="no-such-scorer")
    after = scraped(http)
    assert delta("physarum_reward_samples_total{'scorer': 'exact_match'}") == 2
    assert delta("physarum_reward_score_seconds_count{'scorer': 'exact_match'}") == 1
    assert delta("physarum_reward_samples_total{'scorer': 'custom'}") == 2
    assert delta("physarum_reward_errors_total{'scorer': 'custom', 'type': 'exception'}") == 1
    assert delta("physarum_reward_errors_total{'scorer': 'custom', 'type': 'timeout'}") == 1
    assert delta("physarum_reward_errors_total{'scorer': 'unknown', 'type': 'invalid_request'}") == 1
    assert not any("no-such-scorer" in name for name in after)  # requests never mint label values
