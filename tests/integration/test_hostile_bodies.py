"""Bodies Python's json accepts but no reply can echo (NaN, 1e999999, a lone surrogate) get a 400 naming the problem
from the reward's /v1/score, the rollout manager's /v1/scale and the trainer's /v1/jobs, all real servers on
loopback; gRPC SubmitJob with a NaN answers INVALID_ARGUMENT; an int32 overflow is refused at submit."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest
from google.protobuf import struct_pb2

from services.common.errors import InvalidArgument
from services.common.rest import RestServer
from services.reward.config import RewardConfig
from services.reward.server import create_server as create_reward
from services.rollout.pool.config import PoolConfig
from services.rollout.pool.pool import EnginePool
from services.rollout.pool.router import RouterClient
from services.rollout.rest import create_app as create_rollout_app
from services.trainer.api.client import JobsClient
from services.trainer.api.config import TrainerConfig
from services.trainer.api.server import create_server as create_trainer
from tests.integration.test_buffer import LoopThread

BODIES = {  # (raw body, what the 400 must say)
    "nan": ("NaN", "NaN is not a JSON number"),
    "huge": ('{"replicas": 1e999999, "samples": [], "x": 1e999999}', "1e999999 is out of a float's range"),
    "surrogate": ('{"a": "\\ud800"}', "request body.a: lone surrogate U+D800 at character 0"),
}
DATA = Path(tempfile.mkdtemp(prefix="physarum-hostile-"))
(DATA / "m").mkdir()
(DATA / "m" / "config.json").write_text("{}")
(DATA / "d.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
SPEC = {"hf_checkpoint": str(DATA / "m"), "prompt_data": str(DATA / "d.jsonl"), "num_rollout": 2,
        "rollout_batch_size": 2}


@pytest.fixture(scope="module")
def urls():
    """service -> (REST base URL, gRPC address or None)"""
    loop = LoopThread()
    reward = loop.run(create_reward(RewardConfig(port=0, rest_port=0, default_timeout_s=5.0)))
    trainer = loop.run(create_trainer(TrainerConfig(port=0, rest_port=0), lambda spec, ctx: None))

    async def start_rollout() -> RestServer:
        # a pool with no launcher and no engines: scale(0) and status() touch no router (never called)
        pool = EnginePool(None, RouterClient("http://127.0.0.1:9"), PoolConfig())
        server = RestServer(create_rollout_app(pool), "127.0.0.1", 0)
        await server.start()
        return server

    rollout = loop.run(start_rollout())
    yield {"reward": (f"http://127.0.0.1:{reward.rest.port}/v1/score", None),
           "rollout": (f"http://127.0.0.1:{rollout.port}/v1/scale", None),
           "trainer": (f"http://127.0.0.1:{trainer.rest.port}/v1/jobs", f"127.0.0.1:{trainer.grpc.port}")}
    loop.run(rollout.stop())
    loop.run(trainer.stop(1.0))
    loop.run(reward.stop(1.0))
    loop.close()


@pytest.mark.parametrize("service", ["reward", "rollout", "trainer"])
@pytest.mark.parametrize("body", sorted(BODIES))
def test_bodies_json_cannot_echo_answer_400_naming_the_problem(urls, service, body):
    url, _ = urls[service]
    raw, says = BODIES[body]
    reply = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["detail"]


def test_plain_bodies_still_reach_the_handlers(urls):
    reply = httpx.post(urls["rollout"][0], json={"replicas": 0}, timeout=30)
    assert reply.status_code == 200 and reply.json()["desired_replicas"] == 0
    reply = httpx.post(urls["reward"][0], json={"rm_type": "math", "samples": [{"response": r"\boxed{2}",
                                                                                 "label": "2"}]}, timeout=30)
    assert reply.status_code == 200 and reply.json()["scores"][0]["reward"] == 1.0
    reply = httpx.post(urls["trainer"][0], json={**SPEC, "job_id": "plain", "rollout_stop": ["\u00e9\U0001f600"]},
                       timeout=30)
    assert reply.status_code == 201 and reply.json()["spec"]["rollout_stop"] == ["\u00e9\U0001f600"]


def test_grpc_submit_with_nan_is_invalid_argument(urls):
    _, addr = urls["trainer"]
    with JobsClient(addr) as client:
        with pytest.raises(InvalidArgument, match="job spec: Fail to serialize NaN for Value.number_value"):
            client.submit({**SPEC, "num_rollout": float("nan")})
        with pytest.raises(InvalidArgument, match="Infinity"):
            client.submit({**SPEC, "lr": float("inf")})


def test_grpc_struct_built_by_hand_with_nan_is_invalid_argument(urls):
    """The client's own conversion is not the only way in: a raw Struct with NaN, through the stub."""
    import grpc

    from services.common.gen.physarum.v1 import jobs_pb2, jobs_pb2_grpc

    spec = struct_pb2.Struct()
    spec.update({**SPEC, "job_id": "raw-nan"})
    spec["num_rollout"] = float("nan")
    with grpc.insecure_channel(urls["trainer"][1]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            jobs_pb2_grpc.JobsStub(channel).SubmitJob(jobs_pb2.SubmitJobRequest(spec=spec), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()


@pytest.mark.parametrize("key", ["rollout_max_response_len", "n_samples_per_prompt", "rollout_top_k"])
def test_settings_past_the_rollout_managers_int32_are_refused_at_submit(urls, key):
    reply = httpx.post(urls["trainer"][0], json={**SPEC, key: 99999999999}, timeout=30)
    assert reply.status_code == 400
    assert f"{key}: 99999999999 is out of range (at most 2147483647)" in reply.json()["detail"]
