"""Same-host weight sync (the engine on the trainer's host) against what the host can do: a memcpy of the same bytes
and a round trip through /dev/shm.

`python bench/same_host_sync.py [--rounds 3]`. The model is the weight-sync benchmark's (310 tensors, ~250 MB).
Physarum's side is the broadcaster that weight_sync_backend auto builds (`make_broadcaster("auto", ...)`), to one
CPU engine process on this host: it picks the shared-memory path by itself (one write to /dev/shm here, one read
into the engine's receive buffers there); the gloo group over loopback to the same engine is timed alongside. The
baselines run in this process: `torch` copy of every tensor into preallocated ones (memcpy), and the same bytes
written to a file in /dev/shm and read back into preallocated tensors. Rounds alternate; best of --rounds. Prints a
table, then one JSON line (`same_host_sync_GBps`; the goal is a shared-memory path at >= 2.5 GB/s, used
automatically).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, print_table, start_engine, start_sync_bench  # noqa: E402


def shm_round_trip(tensors: list, targets: list) -> None:
    """Write every tensor's bytes to one /dev/shm file, then read them back into `targets`."""
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="physarum-bench-")
    try:
        with os.fdopen(fd, "wb") as out:
            for tensor in tensors:
                out.write(tensor.numpy().data)
        with open(path, "rb") as src:
            for target in targets:
                src.readinto(target.numpy().data)
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    import torch

    from services.trainer.weight_sync.auto import make_broadcaster

    args, work, model, weights = start_sync_bench(argparse.ArgumentParser(description=__doc__), argv,
                                                  "physarum-bench-shm-")
    tensors = [t for _, t in weights]
    targets = [torch.empty_like(t) for t in tensors]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    engine, url = start_engine(work, model, "engine")
    times: dict[str, list[float]] = {"auto": [], "gloo": [], "memcpy": [], "shm": []}
    auto = make_broadcaster("auto", [url], timeout_s=300.0, model_dir=model)
    gloo = make_broadcaster("gloo", [url], timeout_s=300.0)
    try:
        for i in range(args.rounds + 1):  # round 0: set-up and first touch of every buffer, not counted
            for name, fn in (("auto", lambda: auto.broadcast(weights, f"a{i}")),  # noqa: B023
                             ("gloo", lambda: gloo.broadcast(weights, f"g{i}")),  # noqa: B023
                             ("memcpy", lambda: [dst.copy_(src) for src, dst in zip(tensors, targets, strict=True)]),
                             ("shm", lambda: shm_round_trip(tensors, targets))):
                start = time.perf_counter()
                fn()
                if i:
                    times[name].append(time.perf_counter() - start)
        path = auto.backend
    finally:
        auto.close()
        gloo.close()
        engine.stop()
    best = {name: min(values) for name, values in times.items()}
    gb = num_bytes / 1e9
    rows = [[label, f"{best[name]:.3f}", f"{gb / best[name]:.2f}"] for label, name in (
        ("memcpy (torch copy_, preallocated)", "memcpy"), ("/dev/shm write + read back", "shm"),
        (f"Physarum, weight_sync_backend auto (picked {path}) to 1 engine on this host", "auto"),
        ("Physarum, gloo group over loopback to the same engine", "gloo"))]
    print_table(f"same-host weight sync: {len(weights)} tensors, {num_bytes / 1e6:.0f} MB (best of {args.rounds})",
                ["path", "seconds", "GB/s (goal: a shared-memory path >= 2.5)"], rows)
    emit({"same_host_sync_GBps": gb / best["auto"], "same_host_sync_path": path, "same_host_gloo_GBps":
          gb / best["gloo"], "memcpy_GBps": gb / best["memcpy"], "dev_shm_GBps": gb / best["shm"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
