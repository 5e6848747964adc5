"""EngineProxy: an HTTP pass-through to one engine, put between the router and the engine by the rollout tests to see
what the manager sent: it records /generate (request, reply) pairs and /abort_request bodies, and can hold /generate
requests back."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from services.common import procs

TIMEOUT_S = 120.0  # a held or slow request still ends well within it


class EngineProxy:
    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.generated: list[tuple[dict, dict]] = []
        self.aborts: list[dict] = []
        self.pass_budget: int | None = None  # /generate requests let through before holding; None: all
        self.num_held = 0
        self.released = threading.Event()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.forward(self, "GET")

            def do_POST(self) -> None:
                proxy.forward(self, "POST")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((procs.HOST, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{procs.HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold_after(self, num_requests: int | None) -> None:
        """Let `num_requests` more /generate requests through, then hold each until release()."""
        with self.lock:
            self.pass_budget, self.num_held = num_requests, 0
            self.released.clear()

    def release(self) -> None:
        with self.lock:
            self.pass_budget = None
        self.released.set()

    def requests_of(self, job_id: str) -> list[tuple[dict, dict]]:
        """The recorded /generate (request, reply) pairs of one job (its request ids start with the job id; batches,
        which carry no rid, are left out: see since())."""
        with self.lock:
            return [(req, rep) for req, rep in self.generated if req.get("rid", "").startswith(f"{job_id}-")]

    def since(self, num_records: int) -> list[tuple[dict, dict]]:
        """The (request, reply) pairs recorded after the first num_records."""
        with self.lock:
            return self.generated[num_records:]

    def forward(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if handler.path == "/generate":
            self._wait_if_held()
        if handler.path == "/abort_request":
            with self.lock:
                self.aborts.append(json.loads(body))
        if handler.path == "/generate" and json.loads(body).get("stream"):
            return self._forward_stream(handler, body)
        reply = httpx.request(method, self.engine_url + handler.path, content=body or None, timeout=TIMEOUT_S,
                              headers={"Content-Type": "application/json"} if body else None)
        if handler.path == "/generate" and reply.status_code == 200:
            request, answer = json.loads(body), reply.json()
            inputs = request.get("input_ids") or []
            # a batch (a group's fresh samples) is recorded as one pair per prompt; it carries no rid
            pairs = ([({**request, "input_ids": ids}, one) for ids, one in zip(inputs, answer, strict=True)]
                     if inputs and isinstance(inputs[0], list) else [(request, answer)])
            with self.lock:
                self.generated.extend(pairs)
        try:
            handler.send_response(reply.status_code)
            handler.send_header("Content-Type", reply.headers.get("Content-Type", "application/json"))
            handler.send_header("Content-Length", str(len(reply.content)))
            handler.end_headers()
            handler.wfile.write(reply.content)
        except OSError:
            pass  # the client went away (a cancelled request)

    def _forward_stream(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        """A streamed /generate, passed on event by event as the engine sends them (the reply ends when the
        connection closes: HTTP/1.0); its finishing chunk is recorded as the reply, before it is passed on, so a
        client that has read it finds the record there."""
        with httpx.stream("POST", self.engine_url + "/generate", content=body, timeout=TIMEOUT_S,
                          headers={"Content-Type": "application/json"}) as reply:
            try:
                handler.send_response(reply.status_code)
                handler.send_header("Content-Type", reply.headers.get("Content-Type", "text/event-stream"))
                handler.end_headers()
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["meta_info"].get("finish_reason") is not None:
                            with self.lock:
                                self.generated.append((json.loads(body), chunk))
                    handler.wfile.write(f"{line}\n".encode())
                    handler.wfile.flush()
            except OSError:
                return  # the client went away

    def _wait_if_held(self) -> None:
        with self.lock:
            hold = self.pass_budget is not None and self.pass_budget <= 0
            if self.pass_budget is not None and not hold:
                self.pass_budget -= 1
            self.num_held += hold
        if hold:
            self.released.wait(timeout=TIMEOUT_S)

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
