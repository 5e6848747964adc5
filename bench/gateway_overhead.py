"""The agent gateway's overhead: a 4-turn session through the gateway (the real `openai` client, the OpenAI API,
the chat template, the trajectory record) against the same token requests sent straight to the router's /generate.

`python bench/gateway_overhead.py [--sessions 20]`. One CPU engine (a tiny model with a tools chat template) behind
the real sglang-router; the gateway runs in this process on its own event loop. The first session records the
/generate bodies the gateway sends; every later round runs one session through the gateway and replays those bodies
straight to the router, in alternating order (greedy decoding: both sides generate the same tokens, which is
checked). Overhead = (gateway turn latency - direct latency) / direct latency at p50 and p99, per turn.
Prints a table, then one JSON line (`gateway_overhead_p50`, goal <= 0.10).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, percentile, print_table, start_engine  # noqa: E402
from examples.agent.model import build_agent_model  # noqa: E402
from services.common import procs  # noqa: E402
from services.common.rest import RestServer  # noqa: E402
from services.rollout.gateway.app import create_app  # noqa: E402
from services.rollout.gateway.sessions import SessionRegistry  # noqa: E402
from services.rollout.generation.generate import GenerateContext, sampling_params  # noqa: E402
from services.rollout.generation.prompts import PromptEncoder  # noqa: E402
from services.rollout.generation.router_http import AiohttpPoster, PostReply  # noqa: E402
from services.rollout.local import start_router  # noqa: E402
from services.rollout.pool.router import RouterClient  # noqa: E402

NUM_TURNS = 4
MAX_TOKENS = 16


class RecordingPoster(AiohttpPoster):
    """The gateway's router client, keeping the /generate bodies it sends (less their fresh rid)."""

    def __init__(self) -> None:
        super().__init__(16, 120.0)
        self.bodies: list[dict[str, Any]] = []

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> PostReply:
        self.bodies.append({k: v for k, v in body.items() if k != "rid"})
        return await super().post(url, body, headers)


def gateway_session(client: Any, key: str) -> list[float]:
    """Seconds per turn of one 4-turn conversation through the gateway (the client's kept-alive connections are
    shared by the sessions, as the direct side's are)."""
    client = client.with_options(api_key=key)
    messages: list[dict[str, Any]] = []
    seconds = []
    for turn in range(NUM_TURNS):
        messages.append({"role": "user", "content": f"Turn {turn}: what is {turn}+{turn}?"})
        start = time.perf_counter()
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
        seconds.append(time.perf_counter() - start)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return seconds


def direct_session(http: Any, router_url: str, bodies: list[dict[str, Any]]) -> tuple[list[float], list[list[int]]]:
    seconds, outputs = [], []
    for body in bodies:
        start = time.perf_counter()
        reply = http.post(f"{router_url}/generate", json=body)
        seconds.append(time.perf_counter() - start)
        reply.raise_for_status()
        outputs.append(reply.json()["output_ids"])
    return seconds, outputs


def main(argv: list[str] | None = None) -> int:
    import httpx
    import openai

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=20, help="4-turn sessions per side")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-gateway-"))
    model = build_agent_model(work / "model")
    engine, engine_url = start_engine(work, model, "engine")
    router_port = procs.free_port()
    router = start_router(router_port, procs.free_port(), work / "router.log")
    router_url = f"http://{procs.HOST}:{router_port}"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    poster = RecordingPoster()
    registry = SessionRegistry()
    server = RestServer(create_app(registry), procs.HOST, 0)
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=300)  # noqa: E731
    try:
        with RouterClient(router_url, timeout_s=10.0) as admin:
            admin.add_worker(engine_url, timeout_s=60.0)
        run(server.start())
        gateway_url = f"http://{procs.HOST}:{server.port}/v1"
        ctx = GenerateContext(http=poster, router_url=router_url, name="bench", rid_prefix="bench")
        encoder = PromptEncoder(model)
        params = sampling_params(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=1024,
                                 stop=[], stop_token_ids=[])

        async def open_session() -> str:
            return registry.open(ctx, encoder, params, session_id=f"s{len(poster.bodies)}").key

        client = openai.OpenAI(base_url=gateway_url, api_key="-", timeout=120.0, max_retries=0)
        gateway_session(client, run(open_session()))  # records the bodies; warms up both paths
        bodies = list(poster.bodies)
        times: dict[str, list[float]] = {"gateway": [], "direct": []}
        with httpx.Client(timeout=120.0) as http, client:
            _, expected = direct_session(http, router_url, bodies)
            for round_index in range(args.sessions):
                for side in (("gateway", "direct") if round_index % 2 == 0 else ("direct", "gateway")):
                    if side == "gateway":
                        poster.bodies.clear()
                        times["gateway"] += gateway_session(client, run(open_session()))
                        if poster.bodies != bodies:
                            raise SystemExit("the gateway sent other /generate bodies than in the first session")
                    else:
                        seconds, outputs = direct_session(http, router_url, bodies)
                        if outputs != expected:
                            raise SystemExit("the replayed requests generated other tokens: not greedy?")
                        times["direct"] += seconds
    finally:
        run(server.stop())
        run(poster.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        router.stop()
        engine.stop()
    figures, row = {}, []
    for q in (50, 99):
        direct, gateway = percentile(times["direct"], q), percentile(times["gateway"], q)
        figures[q] = (gateway - direct) / direct
        row += [1e3 * direct, 1e3 * gateway, figures[q]]
    prompt_tokens = [len(body["input_ids"]) for body in bodies]
    print_table(f"agent gateway overhead per turn: {args.sessions} sessions of {NUM_TURNS} turns per side (prompts of "
                f"{prompt_tokens} tokens, up to {MAX_TOKENS} generated)",
                ["direct p50 ms", "gateway p50 ms", "overhead p50 (goal <= 0.10)", "direct p99 ms", "gateway p99 ms",
                 "overhead p99"], [row])
    emit({"gateway_overhead_p50": figures[50], "gateway_overhead_p99": figures[99]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
