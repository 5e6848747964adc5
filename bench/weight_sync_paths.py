"""Weight sync to engines on the trainer's host: gloo broadcast against the shared-memory snapshot (weight_sync_backend
shm), the same weights to the same CPU engines in one run, alternating; seconds per sync, GB/s and engine pause.

Run: python -m bench.weight_sync_paths [--hidden 1024] [--layers 4] [--engines 2] [--rounds 3]
Last line: {"bytes": N, "gloo_s": S, "shm_s": S, "shm_speedup": R}
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from services.trainer.weight_sync.shm import SharedMemoryBroadcaster
from services.trainer.weight_sync.weight_sync import WeightBroadcaster
from testkit.engines import start_engines, stop_engines


def build_model(out_dir: Path, hidden: int, layers: int) -> dict[str, torch.Tensor]:
    """The demo's tokenizer with a larger random Qwen3 (the bytes are in its layers); its weights, each once."""
    from transformers import AutoModelForCausalLM

    from physarum import tasks, tinymodel

    tinymodel.build_tiny_model(out_dir, tasks.corpus(), num_layers=layers, hidden_size=hidden)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        weights = build_model(model_dir, args.hidden, args.layers)
        num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        engines = start_engines(model_dir, Path(tmp) / "logs", args.engines, "--weight-sync-timeout-s", "120")
        urls = [url for _, url in engines]
        syncs = {"gloo": WeightBroadcaster(urls, timeout_s=120.0),
                 "shm": SharedMemoryBroadcaster(urls, timeout_s=120.0, model_dir=model_dir)}
        seconds: dict[str, list[float]] = {name: [] for name in syncs}
        pauses: dict[str, list[float]] = {name: [] for name in syncs}
        try:
            for round_index in range(args.rounds + 1):  # round 0: group set-up and first-touch
                for name, sync in syncs.items():
                    stats = sync.broadcast(weights.items(), f"{name}-{round_index}")
                    if round_index:
                        seconds[name].append(stats["seconds"])
                        pauses[name].append(stats["pause_seconds"])
        finally:
            for sync in syncs.values():
                sync.close()
            stop_engines(engines)
    print(f"{num_bytes / 1e6:.0f} MB of float32 weights to {args.engines} CPU engines, median of {args.rounds}")
    print(f"{'path':<6} {'s/sync':>8} {'GB/s':>7} {'pause s':>8}")
    for name in syncs:
        s = statistics.median(seconds[name])
        print(f"{name:<6} {s:>8.2f} {num_bytes / s / 1e9:>7.2f} {statistics.median(pauses[name]):>8.2f}")
    result = {"bytes": num_bytes, "gloo_s": round(statistics.median(seconds["gloo"]), 3),
              "shm_s": round(statistics.median(seconds["shm"]), 3)}
    result["shm_speedup"] = round(result["gloo_s"] / result["shm_s"], 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
