"""Hostile inputs to the buffer: numbers and counts that would stall Redis, undecodable messages, a busy Redis.

Each is refused (or reported UNAVAILABLE) at once, and the buffer keeps serving other calls.
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.buffer.client import BufferClient
from services.buffer.server import stop_server
from services.common import procs
from services.common.errors import InvalidArgument, Unavailable
from services.common.gen.physarum.v1 import buffer_pb2
from tests.integration.test_buffer import group_for, loop_thread, start_buffer, write_dataset  # noqa: F401

INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    """A Redis of this module's own: one test makes it busy, which must not stall the session's."""
    proc, url = procs.start_redis(tmp_path_factory.mktemp("hostile-redis"), appendonly=False)
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def buffer_addr(loop_thread, private_redis):  # noqa: F811 - loop_thread is the imported fixture
    server = start_buffer(loop_thread, private_redis)
    yield f"127.0.0.1:{server.port}"
    loop_thread.run(stop_server(server, grace_s=0))


@pytest.fixture
def client(buffer_addr):
    with BufferClient(buffer_addr, timeout_s=10.0, max_retries=0, retry_window_s=0.0) as client:
        yield client


@pytest.fixture
def job(client, tmp_path, request) -> str:
    job_id = f"hostile-{abs(hash(request.node.name)) % 10**8}-{time.monotonic_ns() % 10**6}"
    client.load_dataset(job_id, write_dataset(tmp_path / "ten.jsonl", 10), label_key="label")
    return job_id


def test_huge_rollout_id_is_refused_and_save_state_stays_fast(client, job):
    [prompt] = client.lease_prompts(job, 0, 1, 60.0)
    with pytest.raises(InvalidArgument, match=r"rollout_id must be in \[-2, 2147483647\], got 9223372036854775807"):
        client.put_groups([group_for(prompt, rollout_id=INT64_MAX)])
    # the largest id allowed: SaveState walks the rollouts that hold groups, not every number below it
    client.put_groups([group_for(prompt, rollout_id=2**31 - 1)])
    state = client.save_state(job, 0)
    assert state.pending == [f"0:{prompt.index}"]
    with pytest.raises(InvalidArgument, match="rollout_id must be in"):
        client.save_state(job, INT64_MAX)


def test_counts_and_waits_out_of_range_are_refused(client, job):
    with pytest.raises(InvalidArgument, match=r"count must be in \[1, 16384\], got 1000000"):
        client.lease_prompts(job, 0, 1_000_000, 60.0)
    for bad in (math.nan, math.inf, -1.0):  # sent as they are: the client's own deadline would not be finite
        with pytest.raises(InvalidArgument, match="lease_timeout_s must be a finite number"):
            send(client, "LeasePrompts", job_id=job, count=1, lease_timeout_s=bad)
        with pytest.raises(InvalidArgument, match="timeout_s must be a finite number"):
            send(client, "GetBatch", job_id=job, num_groups=1, timeout_s=bad)
    with pytest.raises(InvalidArgument, match="timeout_s must be a finite number"):
        send(client, "TakeBatch", job_id=job, rollout_id=0, num_groups=1, timeout_s=math.nan)
    with pytest.raises(InvalidArgument, match="min_weight_version must be in"):
        client.take_batch(job, 0, 1, min_weight_version=INT64_MAX, stale_policy="drop", timeout_s=0.0)
    assert client.stats(job).num_leased == 0  # nothing above leased anything


@pytest.mark.parametrize("job_id", ["../..", "a/b", "x\x00y", "A" * 64, "x" * 100_000, "{x}", "-a"])
def test_job_ids_that_are_not_dns_labels_are_refused(client, job_id):
    with pytest.raises(InvalidArgument, match="expected a DNS label"):
        client.stats(job_id)


def test_undecodable_messages_answer_invalid_argument(buffer_addr, client, job):
    with grpc.insecure_channel(buffer_addr) as channel:
        for name in ("LeasePrompts", "PutGroups", "GetBatch", "RestoreState"):
            raw = channel.unary_unary(f"/physarum.v1.Buffer/{name}")  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as caught:
                raw(b"\xff\xff\xff\xff\x0f garbage", timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value)
            assert f"/physarum.v1.Buffer/{name}: cannot decode the request" in caught.value.details()
        good = channel.unary_unary("/physarum.v1.Buffer/GetStats")(
            buffer_pb2.GetStatsRequest(job_id=job).SerializeToString(), timeout=10)
    assert buffer_pb2.BufferStats.FromString(good).num_prompts == 10


def send(client: BufferClient, name: str, **fields: object) -> object:
    """Call the RPC `name` with a request of these fields, under a finite deadline of the test's own."""
    request = getattr(buffer_pb2, f"{name}Request")(**fields)
    return client.call(getattr(client.stub, name), request, timeout_s=10.0)


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.1)


def test_busy_redis_is_unavailable_and_health_follows_it(buffer_addr, client, job, private_redis):
    admin = redis.Redis.from_url(private_redis)
    admin.config_set("busy-reply-threshold", 100)  # ms a script runs before Redis answers BUSY to others
    busy = threading.Thread(target=lambda: _swallow(lambda: redis.Redis.from_url(private_redis).eval(
        "local i = 0 while true do i = i + 1 end", 0)), daemon=True)
    busy.start()
    try:
        _wait_for(lambda: _health(buffer_addr) == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING")
        with pytest.raises(Unavailable, match="cannot answer now: BUSY"):
            client.stats(job)
    finally:
        _wait_for(lambda: _swallow(lambda: admin.script_kill()) or not busy.is_alive(), "script killed")
    _wait_for(lambda: _health(buffer_addr) == health_pb2.HealthCheckResponse.SERVING, "SERVING again")
    assert client.stats(job).num_prompts == 10


def _swallow(call) -> bool:
    """Run call; False if Redis refused it (the script already ended, or was killed)."""
    try:
        call()
        return True
    except redis.RedisError:
        return False


def test_dataset_rows_with_lone_surrogates_are_skipped_by_line_and_a_file_of_only_them_is_refused(client, tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"input": "1+1", "label": "2"}\n{"input": "bad \\ud800", "label": "2"}\n'
                     '{"input": "2+2", "label": "4", "metadata": {"\\udfff": 1}}\n')
    info = client.load_dataset("surrogates", str(mixed), label_key="label")
    assert info.num_prompts == 1 and info.num_skipped == 2
    assert "line 2: a string: lone surrogate U+D800" in info.errors[0]
    assert "line 3: a string: lone surrogate U+DFFF" in info.errors[1]
    only = tmp_path / "only.jsonl"
    only.write_text('{"input": "\\ud800", "label": "2"}\n')
    with pytest.raises(InvalidArgument, match="no valid prompts .* lone surrogate U\\+D800"):
        client.load_dataset("surrogates-only", str(only), label_key="label")
