"""The agent gateway alone in its own process, as the rollout service runs it, for bench/gateway_overhead.py: the
gateway's app over one router, plus two bench-only routes: POST /bench/open (a new greedy session: its key) and
GET /bench/bodies (the /generate bodies the gateway sent since the last open, less their fresh rid).

`python bench/_gateway_host.py --model-path M --router-url U --port P`
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common import procs  # noqa: E402
from services.common.rest import RestServer  # noqa: E402
from services.rollout.engine_calls.generate import GenerateContext, sampling_params  # noqa: E402
from services.rollout.engine_calls.router_http import AiohttpPoster, PostReply  # noqa: E402
from services.rollout.gateway.app import create_app  # noqa: E402
from services.rollout.gateway.sessions import SessionRegistry  # noqa: E402
from services.rollout.generation.prompts import PromptEncoder  # noqa: E402


class RecordingPoster(AiohttpPoster):
    """The gateway's router client, keeping the /generate bodies it sends (less their fresh rid)."""

    def __init__(self) -> None:
        super().__init__(16, 120.0)
        self.bodies: list[dict[str, Any]] = []

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> PostReply:
        self.bodies.append({k: v for k, v in body.items() if k != "rid"})
        return await super().post(url, body, headers)


async def serve(model_path: str, router_url: str, port: int) -> None:
    poster, registry = RecordingPoster(), SessionRegistry()
    ctx = GenerateContext(http=poster, router_url=router_url, name="bench", rid_prefix="bench")
    encoder = PromptEncoder(model_path)
    params = sampling_params(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=1024, stop=[], stop_token_ids=[])
    app, opened = create_app(registry), []

    @app.post("/bench/open")
    async def open_session() -> dict[str, str]:
        for session in opened:
            registry.close(session)
        poster.bodies.clear()
        opened.append(registry.open(ctx, encoder, params, session_id=f"s{len(opened)}"))
        return {"key": opened[-1].key}

    @app.get("/bench/bodies")
    async def bodies() -> list[dict[str, Any]]:
        return poster.bodies

    server = RestServer(app, procs.HOST, port)
    await server.start()
    await server.task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--router-url", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.model_path, args.router_url, args.port))


if __name__ == "__main__":
    main()
