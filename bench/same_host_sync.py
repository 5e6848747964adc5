"""Same-host weight sync (the engine on the trainer's host) against what the host can do: a memcpy of the same bytes
and a round trip through /dev/shm.

`python bench/same_host_sync.py [--rounds 3]`. The model is the weight-sync benchmark's (310 tensors, ~250 MB).
Physarum's side is `WeightBroadcaster.broadcast` to one CPU engine process on this host, whatever path it takes
there (gloo over loopback today; a shared-memory path, once the broadcaster has one, is picked by the broadcaster
itself). The baselines run in this process: `torch` copy of every tensor into preallocated ones (memcpy), and the
same bytes written to a file in /dev/shm and read back into preallocated tensors. Best of --rounds. Prints a table,
then one JSON line (`same_host_sync_GBps`; the goal is a shared-memory path at >= 2.5 GB/s, used automatically).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import best_of, emit, print_table, start_engine, start_sync_bench  # noqa: E402


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

    from services.trainer.sync.weight_sync import WeightBroadcaster

    args, work, model, weights = start_sync_bench(argparse.ArgumentParser(description=__doc__), argv,
                                                  "physarum-bench-shm-")
    tensors = [t for _, t in weights]
    targets = [torch.empty_like(t) for t in tensors]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    engine, url = start_engine(work, model, "engine")
    try:
        with WeightBroadcaster([url], timeout_s=300.0) as broadcaster:
            broadcaster.init_group()
            version = iter(range(10**6))
            physarum_s = best_of(lambda: broadcaster.broadcast(weights, f"v{next(version)}"), args.rounds)
    finally:
        engine.stop()
    memcpy_s = best_of(lambda: [dst.copy_(src) for src, dst in zip(tensors, targets, strict=True)], args.rounds)
    shm_s = best_of(lambda: shm_round_trip(tensors, targets), args.rounds)
    gb = num_bytes / 1e9
    rows = [["memcpy (torch copy_, preallocated)", f"{memcpy_s:.3f}", f"{gb / memcpy_s:.2f}"],
            ["/dev/shm write + read back", f"{shm_s:.3f}", f"{gb / shm_s:.2f}"],
            ["Physarum WeightBroadcaster to 1 engine on this host", f"{physarum_s:.3f}", f"{gb / physarum_s:.2f}"]]
    print_table(f"same-host weight sync: {len(weights)} tensors, {num_bytes / 1e6:.0f} MB (best of {args.rounds})",
                ["path", "seconds", "GB/s (goal: a shared-memory path >= 2.5)"], rows)
    emit({"same_host_sync_GBps": gb / physarum_s, "memcpy_GBps": gb / memcpy_s, "dev_shm_GBps": gb / shm_s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
