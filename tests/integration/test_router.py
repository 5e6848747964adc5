"""The real sglang-router with a real CPU engine: registration through /workers, routing, removal.

The engine pool that drives it is tested in test_rollout_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from services.common import procs
from services.common.errors import DeadlineExceeded, NotFound
from services.common.sglang import SGLangClient
from services.rollout.generation.prompts import PromptEncoder


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


@pytest.fixture(scope="module")
def pool(router, cpu_engine_url):
    """The session's engine registered with the router; `ready_before` is the router's readiness before."""
    ready_before = router.ready()
    router.add_worker(cpu_engine_url, timeout_s=60)
    return SimpleNamespace(ready_before=ready_before, urls=[cpu_engine_url])


def generate_body(tiny_model_dir, **sampling) -> dict:
    ids = PromptEncoder(tiny_model_dir).encode_text("12+34=")
    return {"input_ids": ids, "return_logprob": True, "rid": "router-test",
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "no_stop_trim": True, **sampling}}


def test_engine_registers_through_workers_api_and_router_turns_ready(router, pool):
    assert pool.ready_before is False
    (url,) = pool.urls
    workers = router.list_workers()
    assert [w["url"] for w in workers] == [url] and workers[0]["is_healthy"] is True
    assert router.ready()
    readiness = httpx.get(f"{router.url}/readiness", timeout=5).json()
    assert readiness["healthy_workers"] == 1 and readiness["status"] == "ready"


def test_generate_through_router_returns_sglang_shape(router, pool, tiny_model_dir):
    body = generate_body(tiny_model_dir)
    reply = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    meta = data["meta_info"]
    assert isinstance(data["text"], str) and 1 <= len(data["output_ids"]) <= 6
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] == len(body["input_ids"])
    assert meta["completion_tokens"] == len(data["output_ids"]) and isinstance(meta["weight_version"], str)
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == data["output_ids"] and all(e[0] <= 0 and e[2] is None for e in entries)


def test_router_forwards_the_request_unchanged(router, pool, tiny_model_dir):
    body = generate_body(tiny_model_dir, temperature=0.0)
    via_router = httpx.post(f"{router.url}/generate", json=body, timeout=60).json()
    with SGLangClient(pool.urls[0], timeout_s=60) as engine:
        direct = engine.generate(body)
    assert via_router["output_ids"] == direct["output_ids"]
    assert [e[0] for e in via_router["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in direct["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_remove_worker_removes_it_and_add_worker_is_idempotent(router, pool, tiny_model_dir):
    (url,) = pool.urls
    router.remove_worker(url)
    assert router.find_worker(url) is None and not router.ready()
    assert httpx.post(f"{router.url}/generate", json=generate_body(tiny_model_dir), timeout=30).status_code >= 500
    with pytest.raises(NotFound, match=url):
        router.remove_worker(url)
    router.add_worker(url, timeout_s=30)
    router.add_worker(url, timeout_s=30)
    assert [w["url"] for w in router.list_workers()] == [url] and router.ready()


def test_add_worker_of_a_dead_url_fails_naming_it(router):
    dead = f"http://{procs.HOST}:{procs.free_port()}"
    with pytest.raises(DeadlineExceeded, match=f"worker {dead} not listed"):
        router.add_worker(dead, timeout_s=1.5)
