"""The buffer service against a real Redis: datasets, leases and their expiry, idempotent writes, batches, epochs.

Servers run in-process on 127.0.0.1:0 in a background event loop; the tests drive them with the sync client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.buffer.client import STREAM_ROLLOUT_ID, BufferClient
from services.buffer.config import BufferConfig
from services.buffer.server import create_server, stop_server
from services.common import procs
from services.common.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from services.common.grpc_client import wait_for_health
from services.common.samples import Prompt, Sample, SampleGroup, Status, group_id_for


class LoopThread:
    """An asyncio loop in a daemon thread, so in-process aio servers serve while the test blocks on calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def loop_thread():
    loop_thread = LoopThread()
    yield loop_thread
    loop_thread.close()


def start_buffer(loop_thread: LoopThread, redis_url: str, **overrides):
    config = BufferConfig(port=0, redis_url=redis_url, redis_wait_s=5.0, **overrides)
    return loop_thread.run(create_server(config))


@contextlib.contextmanager
def running_buffer_client(redis_url: str) -> Iterator[BufferClient]:
    """An in-process buffer on its own loop thread and a client to it; both stopped on exit (module fixtures)."""
    loop_thread = LoopThread()
    server = start_buffer(loop_thread, redis_url)
    try:
        with BufferClient(f"127.0.0.1:{server.port}", timeout_s=10.0) as client:
            yield client
    finally:
        loop_thread.run(stop_server(server, grace_s=0))
        loop_thread.close()


@pytest.fixture(scope="module")
def buffer_addr(loop_thread, redis_url):
    server = start_buffer(loop_thread, redis_url)
    yield f"127.0.0.1:{server.port}"
    loop_thread.run(stop_server(server, grace_s=0))


@pytest.fixture
def client(buffer_addr):
    with BufferClient(buffer_addr, timeout_s=10.0) as client:
        yield client


@pytest.fixture
def job_id(request) -> str:
    """A DNS-label job id named after the test."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    return f"{name}-{uuid.uuid4().hex[:6]}"


def write_dataset(path, num_prompts: int) -> str:
    path.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(num_prompts)))
    return str(path)


@pytest.fixture
def loaded(client, job_id, tmp_path):
    """A job with 10 prompts q0..q9 (label = index), no shuffle."""
    client.load_dataset(job_id, write_dataset(tmp_path / "ten.jsonl", 10), label_key="label")
    return job_id


def group_for(prompt: Prompt, rollout_id: int = 0, **sample_fields) -> SampleGroup:
    sample = Sample(prompt=prompt.prompt, tokens=[1, 2, 3], response_length=1, label=prompt.label,
                    status=Status.COMPLETED, **sample_fields)
    return SampleGroup(group_id=group_id_for(prompt.job_id, prompt.epoch, prompt.index), job_id=prompt.job_id,
                       rollout_id=rollout_id, prompt_index=prompt.index, epoch=prompt.epoch,
                       lease_id=prompt.lease_id, samples=[sample])


def test_load_dataset_once(client, job_id, tmp_path):
    path = write_dataset(tmp_path / "five.jsonl", 5)
    info = client.load_dataset(job_id, path + "@[1:]", label_key="label")
    assert (info.num_prompts, info.num_skipped, info.already_loaded) == (4, 0, False)
    again = client.load_dataset(job_id, path)  # a later call is a no-op, whatever it names
    assert (again.num_prompts, again.already_loaded) == (4, True)
    stats = client.stats(job_id)
    assert (stats.num_prompts, stats.epoch, stats.cursor, stats.num_leased, stats.num_groups) == (4, 0, 0, 0, 0)
    first = client.lease_prompts(job_id, 0, 1, 60.0)[0]
    assert (first.job_id, first.index, first.epoch, first.prompt, first.label) == (job_id, 0, 0, "q1", "1")


def test_prompts_with_images_load_checked_and_lease_with_their_images(client, job_id, tmp_path):
    """slime's multimodal keys through the service: a bad image skips its row (named), the others lease with their
    images byte for byte."""
    import base64
    import io

    from PIL import Image as PILImage

    def png(size: int) -> bytes:
        out = io.BytesIO()
        PILImage.new("RGB", (size, size), (size, 0, 0)).save(out, format="PNG")
        return out.getvalue()

    (tmp_path / "three.png").write_bytes(png(3))
    rows = [{"input": "<image>count", "label": "3", "images": ["three.png"]},
            {"input": "<image>", "images": ["missing.png"]},
            {"input": "two <image>", "label": "2",
             "images": ["data:image/png;base64," + base64.b64encode(png(2)).decode()]}]
    path = tmp_path / "vlm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = client.load_dataset(job_id, str(path), label_key="label", multimodal_keys={"image": "images"})
    assert (info.num_prompts, info.num_skipped) == (2, 1)
    assert info.errors == [f"dataset {path} line 2: 'images' image 0: image 'missing.png': no such file"]
    first, second = client.lease_prompts(job_id, 0, 2, 60.0)
    assert first.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}]
    assert [(i.data, i.width) for i in first.images] == [(png(3), 3)]
    assert second.messages[0]["content"][-1] == {"type": "image"} and second.images[0].data == png(2)
    with pytest.raises(InvalidArgument, match="modality 'video' is not supported"):
        client.load_dataset(job_id + "-v", str(path), multimodal_keys={"video": "clips"})


def test_lease_then_put_acks_the_lease(client, loaded):
    prompts = client.lease_prompts(loaded, 0, 3, 60.0)
    assert [(p.index, p.epoch, p.prompt, p.label) for p in prompts] == [(i, 0, f"q{i}", str(i)) for i in range(3)]
    assert len({p.lease_id for p in prompts}) == 3 and all(p.lease_id for p in prompts)
    stats = client.stats(loaded)
    assert (stats.cursor, stats.num_leased, stats.num_returned) == (3, 3, 0)
    result = client.put_groups([group_for(p) for p in prompts[:2]])
    assert (result.num_written, result.num_duplicate) == (2, 0)
    stats = client.stats(loaded)
    assert (stats.num_leased, stats.num_groups) == (1, 2)
    assert client.count_groups(loaded, 0) == 2 and client.count_groups(loaded, 1) == 0


def test_unacked_lease_comes_back(client, loaded):
    expiring = client.lease_prompts(loaded, 0, 2, 0.3)
    kept = client.lease_prompts(loaded, 0, 1, 60.0)
    time.sleep(0.5)
    stats = client.stats(loaded)
    assert (stats.num_leased, stats.num_returned, stats.cursor) == (1, 2, 3)
    again = client.lease_prompts(loaded, 0, 3, 60.0)
    assert [p.index for p in again] == [0, 1, 3]  # returned prompts first, then the cursor
    assert not {p.lease_id for p in again} & {p.lease_id for p in expiring + kept}
    assert client.stats(loaded).num_returned == 0


def test_return_prompts(client, loaded):
    prompts = client.lease_prompts(loaded, 0, 3, 60.0)
    assert client.return_prompts(loaded, [prompts[1].lease_id, "no-such-lease"]) == 1
    assert client.return_prompts(loaded, [prompts[1].lease_id]) == 0  # already returned
    assert (client.stats(loaded).num_leased, client.stats(loaded).num_returned) == (2, 1)
    assert [p.index for p in client.lease_prompts(loaded, 0, 2, 60.0)] == [1, 3]


def test_put_groups_twice_stores_once(client, loaded):
    groups = [group_for(p) for p in client.lease_prompts(loaded, 0, 2, 60.0)]
    first = client.put_groups(groups)
    second = client.put_groups(groups)
    assert (first.num_written, first.num_duplicate, second.num_written, second.num_duplicate) == (2, 0, 0, 2)
    assert client.count_groups(loaded, 0) == 2 and client.stats(loaded).num_groups == 2
    assert [g.group_id for g in client.get_batch(loaded, 0, 2, 1.0)] == [g.group_id for g in groups]


def test_group_written_after_its_lease_expired_is_not_served_again(client, loaded):
    [late] = client.lease_prompts(loaded, 0, 1, 0.3)
    time.sleep(0.5)
    assert client.stats(loaded).num_returned == 1  # expired, queued to be served again
    assert client.put_groups([group_for(late)]).num_written == 1
    assert client.stats(loaded).num_returned == 0
    assert [p.index for p in client.lease_prompts(loaded, 0, 1, 60.0)] == [1]

    # expired and leased again; the first holder answers, then the second lease expires: not queued again
    [first] = client.lease_prompts(loaded, 0, 1, 0.3)
    time.sleep(0.5)
    [second] = client.lease_prompts(loaded, 0, 1, 0.3)
    assert (second.index, second.epoch) == (first.index, first.epoch) and second.lease_id != first.lease_id
    assert client.put_groups([group_for(first)]).num_written == 1
    time.sleep(0.5)
    stats = client.stats(loaded)
    assert (stats.num_leased, stats.num_returned, stats.num_groups) == (1, 0, 2)  # index 1 is still leased
    assert [p.index for p in client.lease_prompts(loaded, 0, 1, 60.0)] == [3]


def test_get_batch_waits_for_groups(client, loaded, buffer_addr):
    prompts = client.lease_prompts(loaded, 7, 3, 60.0)

    def write_later() -> None:
        time.sleep(0.4)
        with BufferClient(buffer_addr) as writer:
            writer.put_groups([group_for(prompts[2], rollout_id=7)])
            writer.put_groups([group_for(prompts[0], rollout_id=7)])

    writer = threading.Thread(target=write_later)
    start = time.monotonic()
    writer.start()
    batch = client.get_batch(loaded, 7, 2, timeout_s=10.0)
    elapsed_s = time.monotonic() - start
    writer.join()
    assert elapsed_s >= 0.35
    assert [g.prompt_index for g in batch] == [2, 0]  # write order
    assert all(g.rollout_id == 7 for g in batch)

    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=f"rollout 7 of job {loaded} has 2/3 groups after 0.3 s"):
        client.get_batch(loaded, 7, 3, timeout_s=0.3)
    assert 0.25 <= time.monotonic() - start < 3.0


def expected_orders(num_prompts: int, seed: int, num_epochs: int) -> list[int]:
    orders = []
    for epoch in range(num_epochs):
        order = list(range(num_prompts))
        random.Random(seed + epoch).shuffle(order)
        orders += order
    return orders


def test_epoch_wrap_with_shuffle(client, tmp_path):
    path = write_dataset(tmp_path / "seven.jsonl", 7)
    jobs = [f"shuffle-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    for job, seed in zip(jobs, [123, 123, 7], strict=True):
        client.load_dataset(job, path, rollout_shuffle=True, rollout_seed=seed)

    def lease_all(job: str) -> list[Prompt]:
        leased = []
        for count in (3, 3, 3, 12):  # the third lease spans epochs 0 and 1, the last one epochs 1 to 3
            leased += client.lease_prompts(job, 0, count, 60.0)
        return leased

    leased = lease_all(jobs[0])
    assert [p.index for p in leased] == expected_orders(7, 123, 3)
    assert [p.epoch for p in leased] == [e for e in range(3) for _ in range(7)]
    for epoch in range(3):  # each epoch covers every prompt exactly once
        assert sorted(p.index for p in leased if p.epoch == epoch) == list(range(7))
    assert all(p.prompt == f"q{p.index}" for p in leased)
    stats = client.stats(jobs[0])
    assert (stats.epoch, stats.cursor, stats.num_leased) == (3, 0, 21)
    assert [p.index for p in lease_all(jobs[1])] == [p.index for p in leased]  # same seed, same order
    assert [p.index for p in lease_all(jobs[2])] == expected_orders(7, 7, 3)


def test_epoch_wrap_without_shuffle(client, loaded):
    leased = client.lease_prompts(loaded, 0, 8, 60.0) + client.lease_prompts(loaded, 0, 4, 60.0)
    assert [(p.epoch, p.index) for p in leased] == [(0, i) for i in range(10)] + [(1, 0), (1, 1)]
    stats = client.stats(loaded)
    assert (stats.epoch, stats.cursor) == (1, 2)


def test_replicas_share_one_redis(loop_thread, redis_url, client, job_id, tmp_path, buffer_addr):
    """Two servers on one Redis lease concurrently: every prompt goes out exactly once."""
    other = start_buffer(loop_thread, redis_url)
    try:
        path = write_dataset(tmp_path / "forty.jsonl", 40)
        addrs = [buffer_addr, f"127.0.0.1:{other.port}"]

        def load_and_lease(worker: int) -> list[tuple[int, int]]:
            with BufferClient(addrs[worker % 2]) as replica:
                replica.load_dataset(job_id, path, rollout_shuffle=True, rollout_seed=worker)  # first one wins
                return [(p.epoch, p.index) for _ in range(5) for p in replica.lease_prompts(job_id, 0, 2, 60.0)]

        with ThreadPoolExecutor(4) as pool:
            leased = [slot for slots in pool.map(load_and_lease, range(4)) for slot in slots]
        assert sorted(leased) == [(0, i) for i in range(40)]
        stats = client.stats(job_id)
        assert (stats.num_prompts, stats.epoch, stats.cursor, stats.num_leased) == (40, 1, 0, 40)
    finally:
        loop_thread.run(stop_server(other, grace_s=0))


def test_bad_requests_get_clear_errors_and_the_server_keeps_answering(client, job_id, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1="}\nnot json\n')
    with pytest.raises(InvalidArgument, match=r"no valid prompts \(2 rows skipped\): dataset .*bad.jsonl line 1: "
                                              r"missing key 'input'; dataset .*bad.jsonl line 2: invalid JSON"):
        client.load_dataset(job_id, str(bad))
    with pytest.raises(InvalidArgument, match=f"dataset {tmp_path}/nope.parquet: no such file"):
        client.load_dataset(job_id, str(tmp_path / "nope.parquet"))
    with pytest.raises(NotFound, match=f"job '{job_id}' has no dataset"):
        client.stats(job_id)
    with pytest.raises(NotFound, match=f"job '{job_id}' has no dataset"):
        client.lease_prompts(job_id, 0, 1, 1.0)
    with pytest.raises(InvalidArgument, match="job_id '': expected a DNS label"):
        client.count_groups("", 0)

    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "1+1="}\n{"input": "2+2="}\n')
    info = client.load_dataset(job_id, str(good))  # the failures above stored nothing
    assert (info.num_prompts, info.num_skipped, info.already_loaded) == (1, 1, False)
    assert info.errors == [f"dataset {good} line 1: missing key 'input'"]
    with pytest.raises(InvalidArgument, match=r"count must be in \[1, 16384\], got 0"):
        client.lease_prompts(job_id, 0, 0, 1.0)
    [prompt] = client.lease_prompts(job_id, 0, 1, 60.0)
    wrong = group_for(prompt)
    wrong.group_id = "something-else"
    with pytest.raises(InvalidArgument, match=f"group_id must be '{job_id}:0:0'"):
        client.put_groups([wrong])
    assert client.stats(job_id).num_groups == 0


def test_tokens_and_log_probs_survive_bit_exactly(client, loaded):
    [prompt] = client.lease_prompts(loaded, 3, 1, 60.0)
    log_probs = [-0.1, -math.pi, -1e-300, -5e-324, -2.5e10, 0.0, -0.0, -1 / 3, math.nextafter(-1.0, 0.0)]
    tokens = [0, 151643, 2**31 - 1, 7, 8, 9, 10, 11, 12, 13]
    sample = dict(tokens=tokens, response_length=9, rollout_log_probs=log_probs, loss_mask=[1] * 8 + [0],
                  reward=0.1, weight_versions=["3", "4"], metadata={"score": 0.25, "tag": "x"})
    group = group_for(prompt, rollout_id=3)
    group.samples = [Sample(**sample, index=0), Sample(**sample, index=1, status=Status.TRUNCATED)]
    client.put_groups([group])
    [stored] = client.get_batch(loaded, 3, 1, 1.0)
    assert stored == group
    packed = struct.pack(f"<{len(log_probs)}d", *log_probs)
    assert struct.pack(f"<{len(log_probs)}d", *stored.samples[0].rollout_log_probs) == packed  # -0.0 included


def test_health_is_not_serving_until_redis_answers(loop_thread, session_dir):
    redis_port, grpc_port = procs.free_port(), procs.free_port()
    config = BufferConfig(port=grpc_port, redis_url=f"redis://127.0.0.1:{redis_port}/0", redis_wait_s=20.0)
    starting = asyncio.run_coroutine_threadsafe(create_server(config), loop_thread.loop)
    redis_proc = None
    try:
        with pytest.raises(TimeoutError, match="not SERVING after 0.5 s"):
            wait_for_health(f"127.0.0.1:{grpc_port}", timeout_s=0.5)
        redis_proc, _ = procs.start_redis(session_dir / f"late-redis-{redis_port}", port=redis_port)
        server = starting.result(20)
        wait_for_health(f"127.0.0.1:{grpc_port}", timeout_s=5.0)
        loop_thread.run(stop_server(server, grace_s=0))
    finally:
        if redis_proc is not None:
            redis_proc.stop()

    no_redis = BufferConfig(port=0, redis_url=f"redis://127.0.0.1:{procs.free_port()}/0", redis_wait_s=0.3)
    with pytest.raises(Unavailable, match=r"Redis redis://127.0.0.1:\d+/0: no answer after 0.3 s"):
        loop_thread.run(create_server(no_redis))


def test_buffer_process_serves_and_stops_on_sigterm(redis_url, session_dir):
    port = procs.free_port()
    proc = procs.ManagedProcess("buffer", procs.python_module("services.buffer", "--port", str(port),
                                                              "--redis-url", redis_url),
                                session_dir / "buffer-process.log").start()
    try:
        proc.wait_ready(lambda: _serving(f"127.0.0.1:{port}"), timeout_s=30)
        with BufferClient(f"127.0.0.1:{port}") as client, pytest.raises(NotFound):
            client.stats("no-such-job")
    finally:
        assert proc.stop() == 0


def _serving(addr: str) -> bool:
    try:
        wait_for_health(addr, timeout_s=0.2)
        return True
    except TimeoutError:
        return False


def test_buffer_imports_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "services.buffer", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import")]
    assert "services.buffer.server" in modules and "redis" in modules
    assert not [m for m in modules if m.split(".")[0] == "torch"]


def test_take_batch_assigns_fresh_stream_groups_and_refuses_stale_ones(client, loaded):
    """fully_async: versions 3, 1, 4, 2, 5 on the stream; min version 3 takes 3 and 4 (and 5 on the next call);
    the stale 1 is regenerated (its prompt leased again), the stale 2 dropped (used up for the epoch)."""
    prompts = client.lease_prompts(loaded, STREAM_ROLLOUT_ID, 5, 60.0)
    versions = ["3", "1", "4", "2", "5"]
    client.put_groups([group_for(p, STREAM_ROLLOUT_ID, weight_versions=[v])
                       for p, v in zip(prompts, versions, strict=True)])
    first = client.take_batch(loaded, 0, 2, min_weight_version=3, timeout_s=1.0)
    assert [g.prompt_index for g in first.groups] == [0, 2] and {g.rollout_id for g in first.groups} == {0}
    assert (first.num_stale_dropped, first.num_stale_regenerated) == (0, 1)
    assert client.take_batch(loaded, 0, 2, min_weight_version=9, timeout_s=0.0).groups == first.groups  # idempotent
    second = client.take_batch(loaded, 1, 1, min_weight_version=3, stale_policy="drop", timeout_s=1.0)
    assert [g.prompt_index for g in second.groups] == [4] and second.num_stale_dropped == 1
    assert [p.index for p in client.lease_prompts(loaded, 0, 1, 60.0)] == [1]  # the regenerated prompt first
    with pytest.raises(DeadlineExceeded, match="0/1 fresh groups"):
        client.take_batch(loaded, 2, 1, min_weight_version=0, timeout_s=0.2)
    # a group with an unknown version (SGLang's "default") is never fresh enough
    [late] = client.lease_prompts(loaded, STREAM_ROLLOUT_ID, 1, 60.0)
    client.put_groups([group_for(late, STREAM_ROLLOUT_ID, weight_versions=["default"])])
    with pytest.raises(DeadlineExceeded):
        client.take_batch(loaded, 2, 1, min_weight_version=0, timeout_s=0.2)
    assert client.stats(loaded).num_returned == 1
    # a group with a token newer than the trainer's weights came from a policy it no longer has (before a resume)
    [future] = client.lease_prompts(loaded, STREAM_ROLLOUT_ID, 1, 60.0)
    client.put_groups([group_for(future, STREAM_ROLLOUT_ID, weight_versions=["4", "6"])])
    with pytest.raises(DeadlineExceeded):
        client.take_batch(loaded, 2, 1, min_weight_version=3, max_weight_version=5, timeout_s=0.2)
    assert client.stats(loaded).num_returned == 1 and client.lease_prompts(loaded, 0, 1, 60.0)[0].index == future.index
    with pytest.raises(InvalidArgument, match="stale_policy"):
        client.take_batch(loaded, 2, 1, min_weight_version=0, stale_policy="keep", timeout_s=0.2)
