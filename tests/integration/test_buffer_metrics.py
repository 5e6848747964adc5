"""The buffer's Prometheus endpoint against a real Redis (a database of its own): the backlog gauges follow leases
and writes, the counters count what the RPCs moved, and the metric names are the ones dashboards and HPAs use."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from services.buffer.client import BufferClient
from services.buffer.server import stop_server
from tests.integration.test_buffer import LoopThread, group_for, start_buffer, write_dataset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {f"{s.name}{dict(sorted(s.labels.items())) or ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(port: int, expected: dict[str, float], timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        if all(samples.get(k) == v for k, v in expected.items()):
            return samples
        assert time.monotonic() < deadline, {k: samples.get(k) for k in expected}
        time.sleep(0.1)


@pytest.fixture
def metered(redis_url, tmp_path):
    url = redis_url.rsplit("/", 1)[0] + "/11"  # its own database: the gauges sum over every job in it
    redis_sync.Redis.from_url(url).flushdb()
    loop_thread = LoopThread()
    port = free_port()
    server = start_buffer(loop_thread, url, metrics_port=port, metrics_interval_s=0.1)
    yield server, port
    loop_thread.run(stop_server(server, grace_s=0))
    loop_thread.close()


def test_backlog_gauges_and_counters_follow_the_rpcs(metered, tmp_path):
    server, port = metered
    assert server.metrics.port == port
    with BufferClient(f"127.0.0.1:{server.port}", timeout_s=10.0) as client:
        client.load_dataset("job-a", write_dataset(tmp_path / "ten.jsonl", 10), label_key="label")
        wait_for(port, {"physarum_buffer_jobs": 1, "physarum_buffer_prompts_pending": 10})
        prompts = client.lease_prompts("job-a", 0, 3, 60.0)
        client.put_groups([group_for(p) for p in prompts[:2]])
        client.put_groups([group_for(prompts[0])])  # a retry: stored once
        client.return_prompts("job-a", [prompts[2].lease_id])
        samples = wait_for(port, {"physarum_buffer_prompts_pending": 8, "physarum_buffer_leases_active": 0,
                                  "physarum_buffer_groups_stored": 2})
    assert samples["physarum_buffer_prompts_leased_total"] == 3
    assert samples["physarum_buffer_prompts_returned_total"] == 1
    assert samples["physarum_buffer_groups_written_total"] == 2
    assert samples["physarum_buffer_groups_duplicate_total"] == 1
    assert samples["physarum_buffer_groups_stale_total{'action': 'dropped'}"] == 0
