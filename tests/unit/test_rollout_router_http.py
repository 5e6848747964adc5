"""The manager's /generate client (aiohttp): kept-alive connections, JSON in and out, transport failures as
PostError (which router_generate retries), and the same interface over an httpx MockTransport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import web

from services.common import procs
from services.common.plugin_sample import PluginSample
from services.rollout.engine_calls import generate as gen
from services.rollout.engine_calls.router_http import AiohttpPoster, HttpxPoster, PostError
from tests.unit.rollout_fakes import reply


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, procs.HOST, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port the OS chose
    return runner, f"http://{procs.HOST}:{port}"


def test_aiohttp_poster_keeps_one_connection_alive_and_sends_json_and_headers():
    peers, bodies, keys = set(), [], []

    async def handler(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))
        bodies.append(await request.json())
        keys.append(request.headers.get("X-SMG-Routing-Key"))
        return web.json_response({"n": len(bodies)}, status=200 if len(bodies) < 3 else 503)

    async def main() -> list:
        runner, url = await _serve(handler)
        poster = AiohttpPoster(max_connections=4, timeout_s=10.0)
        try:
            return [await poster.post(f"{url}/generate", {"i": i}, {"X-SMG-Routing-Key": "s"} if i else None)
                    for i in range(3)]
        finally:
            await poster.aclose()
            await runner.cleanup()

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200, 200, 503]
    assert [r.json()["n"] for r in replies] == [1, 2, 3]
    assert bodies == [{"i": 0}, {"i": 1}, {"i": 2}] and keys == [None, "s", "s"]
    assert len(peers) == 1  # one connection, reused


def test_aiohttp_poster_raises_post_error_when_nothing_listens_and_router_generate_retries_it():
    url = f"http://{procs.HOST}:{procs.free_port()}"

    async def one_post() -> None:
        poster = AiohttpPoster(max_connections=1, timeout_s=5.0, connect_timeout_s=5.0)
        try:
            await poster.post(f"{url}/generate", {})
        finally:
            await poster.aclose()

    with pytest.raises(PostError, match="/generate"):
        asyncio.run(one_post())

    attempts = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(json.loads(request.content)["rid"])
        if len(attempts) == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=reply([3], "a"))

    async def generate() -> dict:
        ctx = gen.GenerateContext(http=HttpxPoster(httpx.AsyncClient(transport=httpx.MockTransport(handler))),
                                  router_url="http://router", name="rollout 0 of job j", rid_prefix="j-0",
                                  retry_delay_s=0.0, max_attempts=3)
        gen.use_context(ctx)
        try:
            return await gen.router_generate(PluginSample(group_index=0, index=0), {"input_ids": [1]})
        finally:
            await ctx.http.aclose()

    assert asyncio.run(generate())["output_ids"] == [3]
    assert len(attempts) == 2 and attempts[0] != attempts[1]  # a fresh rid per attempt
