"""What the slime-plugin tests run against: a scripted SGLang engine, a search server in Search-R1's retrieval
format, an in-process reward service, and a rollout manager driving two rollouts of a job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.buffer.client import BufferClient
from services.common import procs
from services.reward.client import RewardClient
from services.reward.config import RewardConfig
from services.reward.server import create_server
from services.rollout.client import RolloutState
from services.rollout.generation.manager import RolloutManager
from services.trainer.api.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "slime_examples"


class JsonServer:
    """A threaded HTTP server answering POST bodies with `handle(path, body) -> (status, reply)`; GETs get {}."""

    def __init__(self, handle: Callable[[str, dict], tuple[int, Any]]) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._reply(200, {})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with server.lock:
                    server.requests.append((self.path, body))
                self._reply(*handle(self.path, body))

            def _reply(self, status: int, reply: Any) -> None:
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer((procs.HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{procs.HOST}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def posts(self, path: str) -> list[dict]:
        with self.lock:
            return [body for p, body in self.requests if p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def engine_reply(tokenizer: Tokenizer, text: str, *, weight_version: str = "v0") -> dict[str, Any]:
    """SGLang's /generate reply for `text`: its tokens with log-prob -0.5 each, finished by a stop string."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return {"text": text, "output_ids": ids,
            "meta_info": {"finish_reason": {"type": "stop", "matched": None}, "weight_version": weight_version,
                          "output_token_logprobs": [[-0.5, i, None] for i in ids], "prompt_tokens": 10,
                          "cached_tokens": 0, "completion_tokens": len(ids)}}


@contextlib.contextmanager
def reward_service() -> Iterator[str]:
    """The Reward service in-process (so it imports the plugins this process can), on a loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(create_server(RewardConfig(port=0, rest_port=0)), loop).result(30)
    try:
        yield f"{procs.HOST}:{server.grpc.port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@contextlib.contextmanager
def on_sys_path(folder: Path) -> Iterator[None]:
    """slime's launch scripts put an example's folder on PYTHONPATH; so does this, for the test's duration."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def run_job_rollouts(spec: dict[str, Any], *, buffer_addr: str, reward_addr: str, router_url: str,
                     num_rollouts: int, timeout_s: float = 120.0) -> list[list]:
    """Load the spec's dataset into the buffer and run rollouts 0..num_rollouts-1 of it on an in-process manager,
    as the trainer would; returns each rollout's groups."""
    job = parse_spec(spec)
    config = job.rollout

    async def main() -> list[list]:
        with BufferClient(buffer_addr, timeout_s=30.0) as buffer, RewardClient(reward_addr, timeout_s=30.0) as reward:
            loaded = buffer.load_dataset(job.job_id, job.prompt_data, input_key=job.input_key,
                                         label_key=job.label_key, apply_chat_template=job.apply_chat_template)
            assert loaded.num_prompts > 0
            manager = RolloutManager(buffer, reward, router_url, model_path=job.hf_checkpoint)
            try:
                out = []
                for rollout_id in range(num_rollouts):
                    manager.start_rollout(config, rollout_id, "v0")
                    await asyncio.wait_for(asyncio.shield(manager.runs[(job.job_id, rollout_id)].task), timeout_s)
                    status = manager.status(job.job_id, rollout_id)
                    assert status.state == RolloutState.DONE, status.error
                    out.append(buffer.get_batch(job.job_id, rollout_id, job.rollout_batch_size, timeout_s=10))
                return out
            finally:
                await manager.close()

    return asyncio.run(main())
