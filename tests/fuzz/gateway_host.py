"""The agent gateway alone in its own process, as the rollout service serves it (its app, its session registry, its
worker pool), over a router: for `make fuzz` and bench/gateway_isolation.py. Opens --sessions sessions at start and
writes their keys, one a line, to --keys-file once it serves.

`python -m tests.fuzz.gateway_host --model-path M --router-url U --port P --sessions N --keys-file F`
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from services.common import procs
from services.common.rest import RestServer
from services.rollout.engine_calls.generate import GenerateContext, sampling_params
from services.rollout.engine_calls.router_http import AiohttpPoster
from services.rollout.gateway.app import create_app
from services.rollout.gateway.sessions import SessionRegistry
from services.rollout.generation.prompts import PromptEncoder


async def serve(args: argparse.Namespace) -> None:
    registry = SessionRegistry(workers=args.workers)
    ctx = GenerateContext(http=AiohttpPoster(64, 120.0), router_url=args.router_url, name="gateway host",
                          rid_prefix="gwhost", max_attempts=2)
    encoder = PromptEncoder(args.model_path)
    params = sampling_params(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=args.max_new_tokens, stop=[],
                             stop_token_ids=[])
    keys = [registry.open(ctx, encoder, params, session_id=f"s{i}").key for i in range(args.sessions)]
    server = RestServer(create_app(registry), procs.HOST, args.port)
    await server.start()
    tmp = Path(f"{args.keys_file}.tmp")
    tmp.write_text("".join(f"{key}\n" for key in keys))
    tmp.replace(args.keys_file)
    await server.task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--router-url", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="each session's response budget")
    parser.add_argument("--workers", type=int, default=4, help="the gateway's worker pool")
    parser.add_argument("--keys-file", required=True)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
