"""Per-service tokens: every port but health, metrics and docs refuses a caller without the callee's token.

The buffer and reward servers run in-process and an engine as a process, each given a token directory; callers
without a token, with another service's token, and with the right one are compared.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.buffer.client import BufferClient
from services.buffer.server import stop_server
from services.common import auth, procs
from services.common.errors import Unauthenticated
from services.common.gen.physarum.v1 import buffer_pb2
from services.common.samples import Sample
from services.common.sglang import SGLangClient
from services.reward.client import RewardClient
from services.reward.config import RewardConfig
from services.reward.server import create_server as create_reward
from services.rollout.local import start_router
from services.rollout.pool.router import RouterClient
from testkit.engines import start_engines, stop_engines
from tests.integration.test_buffer import loop_thread, start_buffer  # noqa: F401


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> dict[str, str]:
    """Tokens of every service in a directory this module's servers and clients read (PHYSARUM_TOKEN_DIR)."""
    token_dir = tmp_path_factory.mktemp("tokens")
    auth.write_tokens(token_dir)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(auth.TOKEN_DIR_ENV, str(token_dir))
        yield {service: auth.read_token(service) for service in auth.SERVICES} | {"dir": str(token_dir)}


@pytest.fixture(scope="module")
def buffer_addr(loop_thread, redis_url, tokens):  # noqa: F811 - loop_thread is the imported fixture
    server = start_buffer(loop_thread, redis_url)
    yield f"127.0.0.1:{server.port}"
    loop_thread.run(stop_server(server, grace_s=0))


@pytest.fixture(scope="module")
def reward(loop_thread, tokens):  # noqa: F811
    server = loop_thread.run(create_reward(RewardConfig(port=0, rest_port=0, num_workers=1)))
    yield server
    loop_thread.run(server.stop(0.5))


def test_the_buffer_refuses_callers_without_its_token_and_health_stays_open(buffer_addr, tokens):
    request = buffer_pb2.GetStatsRequest(job_id="nojob").SerializeToString()
    with grpc.insecure_channel(buffer_addr) as channel:
        stats = channel.unary_unary("/physarum.v1.Buffer/GetStats")
        put = channel.unary_unary("/physarum.v1.Buffer/PutGroups")
        for metadata in [None, [("authorization", f"Bearer {tokens['reward']}")], [("authorization", "Basic x")]]:
            for call, body in [(stats, request), (put, b"\xff\xff garbage")]:
                with pytest.raises(grpc.RpcError) as caught:
                    call(body, timeout=10, metadata=metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
                assert "buffer /physarum.v1.Buffer/" in caught.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with BufferClient(buffer_addr) as client:  # reads the buffer token from PHYSARUM_TOKEN_DIR
        with pytest.raises(Exception, match="has no dataset"):
            client.stats("nojob")
        client.metadata = None
        with pytest.raises(Unauthenticated, match="missing or wrong bearer token"):
            client.stats("nojob")


def test_the_reward_service_needs_its_token_on_grpc_and_rest(reward, tokens):
    body = {"rm_type": "exact_match", "samples": [{"response": "1", "label": "1"}]}
    url = f"http://127.0.0.1:{reward.rest.port}"
    assert httpx.post(f"{url}/v1/score", json=body, timeout=30).status_code == 401
    wrong = auth.bearer(tokens["buffer"])
    assert httpx.post(f"{url}/v1/score", json=body, headers=wrong, timeout=30).status_code == 401
    reply = httpx.post(f"{url}/v1/score", json=body, headers=auth.bearer(tokens["reward"]), timeout=30)
    assert reply.status_code == 200 and reply.json()["scores"][0]["reward"] == 1.0
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    with RewardClient(f"127.0.0.1:{reward.grpc.port}") as client:
        assert [r.reward for r in client.score([Sample(response="1", label="1")], rm_type="exact_match")] == [1.0]
        client.metadata = None
        with pytest.raises(Unauthenticated):
            client.score([Sample()], rm_type="exact_match")


def test_engine_admin_endpoints_need_the_engine_token(tiny_model_dir, tmp_path, tokens):
    [(proc, url)] = start_engines(tiny_model_dir, tmp_path, 1, "--fake-compute", "true")
    try:
        disk = {"model_path": str(tiny_model_dir)}
        for path, body in [("/update_weights_from_disk", disk), ("/pause_generation", {}),
                           ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 1,
                                                           "rank_offset": 0, "world_size": 2}),
                           ("/update_weight_version", {"new_version": "9"})]:
            reply = httpx.post(f"{url}{path}", json=body, timeout=30)
            assert reply.status_code == 401, (path, reply.text)
            reply = httpx.post(f"{url}{path}", json=body, headers=auth.bearer(tokens["buffer"]), timeout=30)
            assert reply.status_code == 401, (path, reply.text)
        for path in ("/health", "/model_info", "/get_server_info"):
            assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
        generated = httpx.post(f"{url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}},
                               timeout=60)
        assert generated.status_code == 200
        with SGLangClient(url) as engine:  # the manager's and trainer's client: sends the engine token
            engine.pause_generation()
            engine.continue_generation()
            engine.flush_cache()
    finally:
        stop_engines([(proc, url)])


def test_the_routers_worker_list_admits_only_the_router_token(tmp_path, tokens):
    """The real sglang-router started with the router token: /workers refuses callers without it or with another
    service's; /generate and the probes stay open; the token is in neither its command line nor its
    environment."""
    port = procs.free_port()
    proc = start_router(port, procs.free_port(), tmp_path / "router.log", env={auth.TOKEN_DIR_ENV: tokens["dir"]})
    url = f"http://{procs.HOST}:{port}"
    try:
        foreign = {"url": "http://127.0.0.1:9"}
        for headers in ({}, auth.bearer(tokens["engine"])):
            assert httpx.post(f"{url}/workers", json=foreign, headers=headers, timeout=10).status_code == 401
            assert httpx.get(f"{url}/workers", headers=headers, timeout=10).status_code == 401
        assert httpx.get(f"{url}/liveness", timeout=10).status_code == 200
        no_worker = httpx.post(f"{url}/generate", json={"input_ids": [5]}, timeout=10)
        assert no_worker.status_code == 503, no_worker.text  # open, and nothing to route to
        with RouterClient(url) as router:  # the manager's client: reads the router token from its token directory
            assert router.list_workers() == []
        for name in ("cmdline", "environ"):
            assert tokens["router"] not in Path(f"/proc/{proc.pid}/{name}").read_bytes().decode(errors="replace")
    finally:
        proc.stop()
