"""Session affinity through sglang-router's manual policy: the gateway sends each session's id as X-SMG-Routing-Key,
so a session's turns land on one engine of two and turns 2..n find their prefix in its cache (the engine's
meta_info.cached_tokens, the agent's usage.prompt_tokens_details.cached_tokens); when that engine leaves the pool,
the session goes on, on the other engine, with no turn lost."""

from __future__ import annotations

import uuid

import openai
import pytest

from services.common import procs
from services.rollout.local import start_router
from services.rollout.pool.router import RouterClient
from testkit.engines import start_engines, stop_engines
from tests.integration.engine_proxy import EngineProxy
from tests.integration.gateway_fixtures import OPENAI_TOOL, QUESTION, GatewayThread, build_tool_model

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def pool(session_dir):
    model_dir = build_tool_model(session_dir / "agent-model")
    port = procs.free_port()
    router_proc = start_router(port, procs.free_port(), session_dir / "affinity-router.log", policy="manual")
    router = RouterClient(f"http://{procs.HOST}:{port}", timeout_s=10.0)
    engines = start_engines(model_dir, session_dir / "affinity-engines", 2)
    proxies = [EngineProxy(url) for _, url in engines]
    gw = None
    try:
        for proxy in proxies:
            router.add_worker(proxy.url, timeout_s=30)
        gw = GatewayThread(model_dir, router.url)
        yield gw, router, proxies
    finally:
        if gw is not None:
            gw.close()
        for proxy in proxies:
            proxy.close()
        stop_engines(engines)
        router.close()
        router_proc.stop()


def turns_of(proxies: list[EngineProxy], starts: list[int]) -> list[tuple[int, list[int], dict]]:
    """(engine index, input_ids, reply meta_info) of each /generate since `starts`, in the order they were served
    (one session at a time here, so its turns are sequential)."""
    served = [(i, request["input_ids"], reply["meta_info"])
              for i, proxy in enumerate(proxies) for request, reply in proxy.since(starts[i])]
    return sorted(served, key=lambda turn: len(turn[1]))  # a session's turns only grow


def talk(client: openai.OpenAI, num_turns: int, messages: list[dict] | None = None) -> tuple[list, list[dict]]:
    """The calculator conversation, then "again" turns: `num_turns` completions; their usages and the history. A
    system prompt of its own keeps a session's prefix apart from the others' past its first few tokens."""
    messages = messages or [{"role": "system", "content": f"Session {uuid.uuid4().hex}."},
                            {"role": "user", "content": QUESTION}]
    usages = []
    for _ in range(num_turns):
        reply = client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0,
                                               max_tokens=40)
        usages.append(reply.usage)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += ([{"role": "tool", "tool_call_id": c.id, "content": "5"} for c in message.tool_calls]
                     if message.tool_calls else [{"role": "user", "content": "And again?"}])
    return usages, messages


def test_a_sessions_turns_stay_on_one_engine_and_hit_its_prefix_cache(pool):
    gw, _, proxies = pool
    engines_used = set()
    for _ in range(4):
        session = gw.open(max_new_tokens=400)
        starts = [len(p.generated) for p in proxies]
        usages, _ = talk(openai.OpenAI(base_url=f"{gw.url}/v1", api_key=session.key, timeout=TIMEOUT_S,
                                       max_retries=0), 3)
        served = turns_of(proxies, starts)
        assert len(served) == 3 and len({engine for engine, _, _ in served}) == 1
        engines_used.add(served[0][0])
        for (_, before, meta), (_, after, next_meta), usage in zip(served[:-1], served[1:], usages[1:], strict=True):
            # all the previous turn computed, its last token aside (never fed back), is in the cache
            computed = len(before) + meta["completion_tokens"] - 1
            assert after[:computed] == before + [e[1] for e in meta["output_token_logprobs"]][:-1]
            assert next_meta["cached_tokens"] == computed == usage.prompt_tokens_details.cached_tokens
    # four sessions keyed at random: both engines served some (all on one would be 1 in 8)
    print(f"engines used by 4 sessions: {sorted(engines_used)}")


def test_a_session_whose_engine_leaves_the_pool_goes_on_on_the_other(pool):
    gw, router, proxies = pool
    session = gw.open(max_new_tokens=400)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    starts = [len(p.generated) for p in proxies]
    _, messages = talk(client, 1)
    [(first_engine, _, _)] = turns_of(proxies, starts)
    router.remove_worker(proxies[first_engine].url)
    try:
        usages, _ = talk(client, 2, messages)
    finally:
        router.add_worker(proxies[first_engine].url, timeout_s=30)
    served = turns_of(proxies, starts)
    assert [engine for engine, _, _ in served] == [first_engine, 1 - first_engine, 1 - first_engine]
    assert usages[0].prompt_tokens_details.cached_tokens < len(served[0][1])  # a cold engine: the prompt anew
    _, second_input, second_meta = served[1]  # and its cache from then on
    assert usages[1].prompt_tokens_details.cached_tokens == len(second_input) + second_meta["completion_tokens"] - 1
    trained = session.trajectory.tip.tokens()
    _, last_input, last_meta = served[-1]
    assert trained == last_input + [e[1] for e in last_meta["output_token_logprobs"]]
    assert session.num_turns == 3 and session.trajectory.branches == []
