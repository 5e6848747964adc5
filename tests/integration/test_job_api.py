"""The job API over REST and gRPC, in-process, with a stand-in runner (the real loop runs in tests/e2e)."""

import asyncio
import contextlib
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.common.errors import InvalidArgument, NotFound, Unauthenticated
from services.trainer.api.client import JobsClient, JobsRestClient
from services.trainer.api.config import TrainerConfig
from services.trainer.api.server import create_server

DATA = Path(tempfile.mkdtemp(prefix="physarum-job-api-"))  # submit checks that a spec's paths exist
(DATA / "m").mkdir()
(DATA / "m" / "config.json").write_text("{}")
(DATA / "d.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
SPEC = {"hf_checkpoint": str(DATA / "m"), "prompt_data": str(DATA / "d.jsonl"), "num_rollout": 3,
        "rollout_batch_size": 2}


def runner(spec, ctx):
    for rollout_id in range(spec.num_rollout):
        ctx.check_cancelled()
        ctx.report(rollout_id, {"rollout/reward_mean": 0.25 * rollout_id})
        time.sleep(0.05 if spec.job_id != "slow" else 0.5)


@contextlib.contextmanager
def servers_with_token(api_token: str):
    """The job API with an operator token, in a thread of its own: (REST url, gRPC address)."""
    loop = asyncio.new_event_loop()
    servers = loop.run_until_complete(create_server(TrainerConfig(port=0, rest_port=0, api_token=api_token), runner))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{servers.rest.port}", f"127.0.0.1:{servers.grpc.port}"
    finally:
        asyncio.run_coroutine_threadsafe(servers.stop(1.0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def servers():
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder = {}

    async def run():
        holder["servers"] = await create_server(TrainerConfig(port=0, rest_port=0), runner)
        holder["stop"] = asyncio.Event()
        ready.set()
        await holder["stop"].wait()
        await holder["servers"].stop(1.0)

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    servers = holder["servers"]
    yield f"127.0.0.1:{servers.grpc.port}", f"http://127.0.0.1:{servers.rest.port}"
    loop.call_soon_threadsafe(holder["stop"].set)
    thread.join(10)


def test_rest_submit_follow_and_openapi(servers):
    _, url = servers
    with JobsRestClient(url) as client:
        job = client.submit({**SPEC, "job_id": "rest-1"})
        assert job["state"] in ("QUEUED", "RUNNING") and job["num_rollout"] == 3
        deadline = time.monotonic() + 10
        while client.get("rest-1")["state"] != "SUCCEEDED":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        done = client.get("rest-1")
        assert done["rollout_id"] == 2 and done["metrics"]["rollout/reward_mean"] == 0.5
        rewards = [e["metrics"]["rollout/reward_mean"] for e in client.events("rest-1") if e["metrics"]]
        assert rewards == [0.0, 0.25, 0.5]
    docs = httpx.get(f"{url}/openapi.json", timeout=5).json()
    assert "/v1/jobs" in docs["paths"] and "/v1/jobs/{job_id}/cancel" in docs["paths"]
    assert httpx.get(f"{url}/docs", timeout=5).status_code == 200


def test_malformed_spec_is_rejected_by_name_and_the_api_stays_up(servers):
    grpc_addr, url = servers
    reply = httpx.post(f"{url}/v1/jobs", json={**SPEC, "n_sample_per_prompt": 4}, timeout=5)
    assert reply.status_code == 400
    assert "unknown key 'n_sample_per_prompt' (did you mean 'n_samples_per_prompt'?)" in reply.json()["detail"]
    with JobsClient(grpc_addr) as client, pytest.raises(InvalidArgument, match="rollout_batch_size must be > 0"):
        client.submit({**SPEC, "rollout_batch_size": 0})
    assert httpx.get(f"{url}/healthz", timeout=5).json() == {"status": "ok"}
    with JobsRestClient(url) as client, pytest.raises(NotFound, match="job 'missing' not found"):
        client.get("missing")


@pytest.mark.parametrize("body", [
    '"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 2, "lr": NaN',
    '"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 2, "lr": Infinity',
    '"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 2, "seed": '
    + "9" * 30,
    '"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 2, '
    '"global_batch_size": 0',
    '"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 2, "job_id": "../.."',
])
def test_hostile_numbers_and_names_answer_400_and_listing_still_works(servers, body):
    _, url = servers
    reply = httpx.post(f"{url}/v1/jobs", content="{" + body + "}", headers={"content-type": "application/json"},
                       timeout=5)
    assert reply.status_code == 400, reply.text
    assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 200


def test_grpc_submit_stream_events_and_cancel(servers):
    grpc_addr, _ = servers
    with JobsClient(grpc_addr) as client:
        client.submit({**SPEC, "job_id": "grpc-1"})
        events = list(client.stream_events("grpc-1", timeout_s=20))
        assert events[-1]["state"] == "SUCCEEDED"
        assert [e["rollout_id"] for e in events if e["metrics"]] == [0, 1, 2]
        client.submit({**SPEC, "job_id": "slow", "num_rollout": 50})
        time.sleep(0.3)
        client.cancel("slow")
        states = [e["state"] for e in client.stream_events("slow", timeout_s=20)]
        assert states[-1] == "CANCELLED"
        assert {j["job_id"] for j in client.list()} >= {"grpc-1", "slow"}


def test_a_configured_token_is_required_on_rest_and_grpc():
    with servers_with_token("s3cret") as (url, grpc_addr):
        assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401
        assert httpx.get(f"{url}/v1/jobs", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200  # probes need no token
        with JobsRestClient(url, token="s3cret") as client:
            assert client.submit({**SPEC, "job_id": "authed"})["job_id"] == "authed"
        with JobsRestClient(url) as client, pytest.raises(Unauthenticated, match="missing or wrong bearer token"):
            client.list()
        with JobsClient(grpc_addr) as client, pytest.raises(Unauthenticated, match="bearer token"):
            client.list()
        with JobsClient(grpc_addr, token="s3cret") as client:
            assert "authed" in {j["job_id"] for j in client.list()}


def test_a_jobs_own_token_opens_its_paths_and_no_other_jobs():
    """Two jobs (two LoRA jobs sharing a pool, say): job a's token reads a's record, events and samples and cancels
    a; it cannot read, follow or cancel b, list the jobs, submit, or touch the pool; gRPC takes the operator's token
    alone."""
    with servers_with_token("s3cret") as (url, grpc_addr):
        with JobsRestClient(url, token="s3cret") as operator:
            a = operator.submit({**SPEC, "job_id": "own-a", "num_rollout": 50})
            b = operator.submit({**SPEC, "job_id": "own-b", "num_rollout": 50})
        assert a["job_token"] and b["job_token"] and a["job_token"] != b["job_token"]
        with JobsClient(grpc_addr, token="s3cret") as grpc_operator:
            c = grpc_operator.submit({**SPEC, "job_id": "own-c"})
        assert c["job_token"] not in ("", a["job_token"])
        own = {"Authorization": f"Bearer {a['job_token']}"}
        for path in ("/v1/jobs/own-a", "/v1/jobs/own-a/events", "/v1/dashboard/jobs/own-a/samples",
                     "/v1/dashboard/jobs/own-a/samples/0/session", "/v1/dashboard/jobs/own-a/checkpoints"):
            assert httpx.get(url + path, headers=own, timeout=5).status_code != 401, path
        for path in ("/v1/jobs/own-b", "/v1/jobs/own-b/events", "/v1/dashboard/jobs/own-b/samples",
                     "/v1/dashboard/jobs/own-b/samples/0/session",
                     "/v1/dashboard/buffer/own-b", "/v1/jobs", "/v1/queue", "/v1/dashboard/pool",
                     "/v1/jobs/own-a/../own-b"):
            assert httpx.get(url + path, headers=own, timeout=5).status_code == 401, path
        for path in ("/v1/jobs/own-b/cancel", "/v1/dashboard/pool/scale"):
            assert httpx.post(url + path, headers=own, json={}, timeout=5).status_code == 401, path
        assert httpx.post(f"{url}/v1/jobs", headers=own, json={**SPEC, "job_id": "own-d"}, timeout=5).status_code \
            == 401
        with JobsRestClient(url, token=a["job_token"]) as client:
            assert client.get("own-a")["job_id"] == "own-a"
            assert client.cancel("own-a")["job_id"] == "own-a"
            with pytest.raises(Unauthenticated, match="a job's own token for that job's paths alone"):
                client.cancel("own-b")
        with JobsRestClient(url, token="s3cret") as operator:
            assert operator.get("own-b")["state"] in ("QUEUED", "RUNNING")  # b was never cancelled
            operator.cancel("own-b")
            assert "job_token" not in operator.get("own-a")  # given at submit alone
        with JobsClient(grpc_addr, token=a["job_token"]) as client, pytest.raises(Unauthenticated):
            client.get("own-a")


def test_slime_args_submit_over_rest_grpc_and_the_cli(servers, tmp_path):
    from physarum.cli import load_job_file

    grpc_addr, url = servers
    argv = (f"--hf-checkpoint {DATA / 'm'} --prompt-data {DATA / 'd.jsonl'} --num-rollout 2 --rollout-batch-size 2 "
            "--n-samples-per-prompt 4 --rm-type deepscaler --colocate --train-backend fsdp")
    with JobsRestClient(url) as rest, JobsClient(grpc_addr) as grpc:
        via_rest = rest.submit({"slime_args": argv, "job_id": "slime-rest"})
        via_grpc = grpc.submit({"slime_args": argv.split(), "job_id": "slime-grpc"})
        for job in (via_rest, rest.get("slime-grpc")):
            spec = job["spec"]
            assert (spec["rm_type"], spec["n_samples_per_prompt"], spec["train_backend"]) == ("deepscaler", 4, "fsdp")
            assert spec["plugin_args"]["colocate"] is True and spec["slime_notes"][0].startswith("--colocate: ")
        assert via_grpc["job_id"] == "slime-grpc"
        with pytest.raises(InvalidArgument, match="slime_args: --allgather-cp: slime's all-gather CP layout is not "
                                                  "implemented"):
            grpc.submit({"slime_args": argv + " --allgather-cp"})
    job_file = tmp_path / "job.yaml"
    job_file.write_text("job_id: from-file\nrm_type: math\n")
    assert load_job_file(job_file, ["num_rollout=5"], argv) == {"job_id": "from-file", "rm_type": "math",
                                                                 "num_rollout": 5, "slime_args": argv}
    assert load_job_file(None, [], argv) == {"slime_args": argv}
