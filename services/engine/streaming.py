"""SGLang's streamed /generate (`"stream": true`): server-sent events, one `data: {json}` per step of each request
with its cumulative text, output_ids and meta_info (finish_reason null until its last chunk), then `data: [DONE]`.
A client that goes away aborts its requests. Knows nothing of HTTP routing (server.py) or of generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from services.engine.protocol import GenerateCall, to_chunk, to_response
from services.engine.scheduler import Request, Scheduler

DONE = "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_chunks(engine: Scheduler, call: GenerateCall) -> AsyncIterator[str]:
    """Submit the call's requests and yield their chunks as tokens arrive; steps that arrive faster than the client
    reads are merged (each chunk is cumulative, so only the newest matters)."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[int] = asyncio.Queue()
    latest = [0] * len(call.requests)  # tokens generated per request when last told
    for position, request in enumerate(call.requests):
        def on_token(_: Request, num_tokens: int, position: int = position) -> None:
            latest[position] = num_tokens
            loop.call_soon_threadsafe(updates.put_nowait, position)
        request.on_token = on_token
        request.on_finish = lambda _, position=position: loop.call_soon_threadsafe(updates.put_nowait, position)
    sent = [0] * len(call.requests)
    num_finished = 0
    engine.submit(call.requests)
    try:
        while num_finished < len(call.requests):
            position = await updates.get()
            request = call.requests[position]
            index = position if call.listed else None
            if request.finished:
                if sent[position] >= 0:
                    sent[position] = -1
                    num_finished += 1
                    yield _event(to_response(request, call.return_logprob[position], index))
                continue
            num_tokens = latest[position]
            if 0 <= sent[position] < num_tokens:
                sent[position] = num_tokens
                text = engine.decode(request.output_ids[:num_tokens], request.params.skip_special_tokens)
                chunk = to_chunk(request, call.return_logprob[position], index, num_tokens, text)
                chunk["meta_info"]["weight_version"] = engine.weight_version
                yield _event(chunk)
        yield DONE
    finally:
        for request in call.requests:
            if not request.finished:
                engine.abort(request.rid, message="client went away")
