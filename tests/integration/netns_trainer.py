"""The trainer pod of the netns weight-sync test: rank 0 (WeightBroadcaster) in its own namespace, driven over pipes.

All HTTP to the engines goes from here, inside the namespaces. TrainerPod is the test's end of the pipes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import select
import sys
import time

import httpx
import torch

from testkit.netns import PodProcess
from tests.integration.hf_weights import hf_weights, perturbed


def digest(values: torch.Tensor) -> str:
    return hashlib.sha256(values.detach().to(torch.float32).contiguous().flatten().numpy().tobytes()).hexdigest()


class Trainer:
    """Answers the requests; keeps one WeightBroadcaster (and so one weight-update group) across them."""

    def __init__(self, model_dir: str, master_address: str, timeout_s: float) -> None:
        from services.trainer.weight_sync.weight_sync import WeightBroadcaster

        self.weights = hf_weights(model_dir)
        self.timeout_s = timeout_s
        self.sync = WeightBroadcaster([], master_address=master_address, timeout_s=timeout_s,
                                      bucket_bytes=256 << 10)

    def broadcast(self, urls: list[str], seed: int, version: str) -> dict:
        from services.trainer.weight_sync.weight_sync import WeightSyncError

        weights = perturbed(self.weights, seed)
        self.sync.set_engines(urls)
        start = time.monotonic()
        try:
            stats = self.sync.broadcast(weights.items(), version)
        except WeightSyncError as err:
            failed = getattr(err.__cause__, "failed_urls", err.failed_urls)
            return {"ok": False, "seconds": time.monotonic() - start, "error": str(err), "failed_urls": list(failed)}
        return {"ok": True, "seconds": time.monotonic() - start, "stats": stats}

    def digests(self, url: str, numels: dict[str, int]) -> dict:
        result = {}
        for name, numel in numels.items():
            reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": numel},
                               timeout=self.timeout_s)
            reply.raise_for_status()
            result[name] = digest(torch.tensor(reply.json(), dtype=torch.float32))
        return {"digests": result}

    def http(self, method: str, url: str, json: dict | None = None) -> dict:
        try:
            reply = httpx.request(method, url, json=json, timeout=self.timeout_s)
        except httpx.HTTPError as err:
            return {"error": f"{type(err).__name__}: {err}"}
        try:
            body = reply.json()
        except ValueError:
            body = reply.text
        return {"status": reply.status_code, "json": body}

    def handle(self, request: dict) -> dict:
        op = request.pop("op")
        if op not in ("broadcast", "digests", "http"):
            raise ValueError(f"unknown op {op!r}; expected broadcast, digests or http")
        return getattr(self, op)(**request)


def main(argv: list[str] | None = None) -> None:
    """Load the model, print {"ready": true}, then answer each JSON request line on stdin with one line on stdout:

    {"op": "broadcast", "urls": [...], "seed": 1, "version": "v1"} -> {"ok", "seconds", "stats"|"error", "failed_urls"}
    {"op": "digests", "url": U, "numels": {name: numel}} -> {"digests": {name: sha256 of the engine's values}}
    {"op": "http", "method": "GET", "url": U, "json": {...}} -> {"status", "json"} or {"error"}
    A request that raises is answered {"exception": "..."}.
    """
    parser = argparse.ArgumentParser(description="trainer pod of the netns weight-sync test")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--master-address", required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stdout is the reply channel: anything else printed goes to the log
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    trainer = Trainer(args.model_path, args.master_address, args.timeout_s)
    out.write(json.dumps({"ready": True}) + "\n")
    try:
        for line in sys.stdin:
            try:
                reply = trainer.handle(json.loads(line))
            except Exception as err:  # reported to the test, which fails on it
                logging.exception("request %s", line.strip())
                reply = {"exception": f"{type(err).__name__}: {err}"}
            out.write(json.dumps(reply) + "\n")
    finally:
        trainer.sync.close()


class TrainerPod:
    """The test's end: send a request line, read the reply line with a deadline."""

    def __init__(self, proc: PodProcess) -> None:
        self.proc = proc
        self.buffer = b""

    def read(self, timeout_s: float) -> dict:
        fd = self.proc.popen.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"trainer pod: no reply in {timeout_s} s; log {self.proc.log_path}:\n"
                                   f"{self.proc.log_tail()}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"trainer pod exited ({self.proc.popen.wait(5)}); log {self.proc.log_path}:\n"
                                   f"{self.proc.log_tail()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, op: str, timeout_s: float = 60.0, **fields) -> dict:
        self.proc.popen.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        self.proc.popen.stdin.flush()
        reply = self.read(timeout_s)
        if "exception" in reply:
            raise RuntimeError(f"trainer pod: {op} {fields}: {reply['exception']}")
        return reply


if __name__ == "__main__":
    main()
