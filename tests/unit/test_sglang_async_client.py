"""AsyncSGLangClient, the pool's and the aborter's client of many engines: a client per engine, bounded in number,
each call answered by the engine it names."""

from __future__ import annotations

import asyncio

import httpx

from services.common.sglang import AsyncSGLangClient


def test_each_engine_has_its_own_client_and_the_least_recently_used_one_is_closed_past_the_bound():
    seen: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:  # three engines that answer with their own port
        seen.append(f"{request.url.port} {request.url.path}")
        return httpx.Response(200, json={"weight_version": str(request.url.port)})

    async def run() -> None:
        engines = AsyncSGLangClient(timeout_s=5.0, transport=httpx.MockTransport(engine))
        engines.MAX_ENGINES = 2
        urls = [f"http://10.0.0.{i}:{9000 + i}" for i in range(3)]
        assert [await engines.weight_version(url + "/") for url in urls[:2]] == ["9000", "9001"]
        first = engines.clients[urls[0]]
        assert await engines.health_generate(urls[0])  # the first engine is now the most recently used
        assert await engines.weight_version(urls[2]) == "9002"  # so the second engine's client is closed
        assert list(engines.clients) == [urls[0], urls[2]] and engines.clients[urls[0]] is first
        assert await engines.weight_version(urls[1]) == "9001"  # a new client for it, closing the first's
        assert list(engines.clients) == [urls[2], urls[1]] and first.is_closed
        kept = list(engines.clients.values())
        await engines.close()
        assert engines.clients == {} and all(client.is_closed for client in kept)

    asyncio.run(run())
    assert seen == ["9000 /model_info", "9001 /model_info", "9000 /health_generate", "9002 /model_info",
                    "9001 /model_info"]
