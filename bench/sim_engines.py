"""Many simulated engines in one process: one asyncio HTTP server per port, answering SGLang's API with a fixed
latency per /generate and joining the trainer's weight-update group for real (a gloo rank each, in threads).

`python bench/sim_engines.py --num-engines 64 --latency-s 0.02 --urls-file PATH`: writes the engines' URLs to PATH
once all listen, then serves until SIGTERM. For bench/control_plane.py: the control plane meets 64 engines without
64 engine processes on a 2-core machine. Plain HTTP/1.1 with keep-alive; no model, random tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOST = "127.0.0.1"
VOCAB = 64


class SimEngine:
    """One engine's state: its weight version and weight-update groups."""

    def __init__(self, port: int, latency_s: float) -> None:
        self.port, self.latency_s = port, latency_s
        self.weight_version = "default"
        self.groups: dict[str, object] = {}

    def info(self) -> dict:
        return {"model_path": "sim", "served_model_name": "sim", "tokenizer_path": "sim", "is_generation": True,
                "weight_version": self.weight_version, "max_context_length": 4096, "max_total_num_tokens": 1 << 20,
                "tp_size": 1, "dp_size": 1, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                "internal_states": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "paused": False}]}

    async def generate(self, body: dict) -> dict | list[dict]:
        """One reply, or a list for a batch of input_ids (decoded together: one latency for the batch)."""
        await asyncio.sleep(self.latency_s)
        inputs = body.get("input_ids") or []
        if inputs and isinstance(inputs[0], list):
            return [self.reply(body, prompt) for prompt in inputs]
        return self.reply(body, inputs)

    def reply(self, body: dict, input_ids: list[int]) -> dict:
        num = int(body.get("sampling_params", {}).get("max_new_tokens", 8))
        ids = [random.randrange(VOCAB) for _ in range(num)]
        meta = {"id": body.get("rid", ""), "finish_reason": {"type": "length", "length": num},
                "prompt_tokens": len(input_ids), "completion_tokens": num, "cached_tokens": 0,
                "weight_version": self.weight_version, "e2e_latency": self.latency_s}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-4.0, t, None] for t in ids]
        return {"text": "", "output_ids": ids, "meta_info": meta}

    def join_group(self, body: dict) -> dict:
        """A gloo rank of the trainer's group (blocks until every rank joined), through the CPU engine's store client.
        The CPU engine joins through torch's group registry, which holds one group per name and process, so each
        simulated engine builds its rank directly, on the store keys the registry path uses (group name, then
        "name/", then "cpu/")."""
        import torch.distributed as dist

        from services.engine.group_store import GroupStoreClient

        name = body.get("group_name", "weight_update_group")
        timeout = datetime.timedelta(seconds=120)
        store = GroupStoreClient(body["master_address"], int(body["master_port"]), timeout)
        prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
        try:
            group = dist.ProcessGroupGloo(prefixed, int(body["rank_offset"]), int(body["world_size"]), timeout)
        except BaseException:
            store.close()
            raise
        self.groups[name] = (group, store)  # the store stays referenced while its group lives
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def drop_group(self, name: str) -> bool:
        """As the CPU engine does: the group's teardown (a connection to every peer) runs on a thread of its own."""
        last = [self.groups.pop(name, None)]
        found = last[0] is not None
        threading.Thread(target=last.clear, daemon=True).start()
        return found

    async def handle(self, method: str, path: str, body: dict) -> tuple[int, dict | list[dict]]:
        path = path.split("?")[0]
        if path == "/generate":
            return 200, await self.generate(body)
        if method == "GET":
            return 200, self.info()
        if path == "/init_weights_update_group":
            return 200, await asyncio.to_thread(self.join_group, body)
        if path == "/destroy_weights_update_group":
            found = await asyncio.to_thread(self.drop_group, body.get("group_name", "weight_update_group"))
            return (200 if found else 404), {"success": bool(found), "message": "destroyed" if found else "none"}
        if path == "/update_weight_version":
            self.weight_version = str(body.get("new_version", self.weight_version))
        return 200, {"success": True, "message": "ok"}

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                status, reply = await self.handle(method, path, json.loads(raw) if raw else {})
                data = json.dumps(reply).encode()
                writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(data), data))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def run(num_engines: int, latency_s: float, urls_file: Path) -> None:
    # every engine's join blocks a thread until the whole group has joined: a thread each
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(2 * num_engines + 8))
    servers, urls = [], []
    for _ in range(num_engines):
        engine = SimEngine(0, latency_s)
        server = await asyncio.start_server(engine.serve, HOST, 0, backlog=1024)
        engine.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        urls.append(f"http://{HOST}:{engine.port}")
    urls_file.write_text("\n".join(urls) + "\n")
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-engines", type=int, default=64)
    parser.add_argument("--latency-s", type=float, default=0.02)
    parser.add_argument("--urls-file", type=Path, required=True)
    args = parser.parse_args(argv)
    threading.excepthook = lambda hook: print(f"sim engine thread: {hook.exc_value!r}", file=sys.stderr)
    asyncio.run(run(args.num_engines, args.latency_s, args.urls_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
