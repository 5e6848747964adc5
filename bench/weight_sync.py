"""Weight sync trainer -> 2 engines over SGLang's protocol against a raw torch.distributed gloo broadcast of the same
bytes between the same number of processes.

`python bench/weight_sync.py [--rounds 3]`. The model has 310 tensors, ~250 MB (28 layers, hidden 384). Physarum's
side: two CPU engine processes and this process as the trainer (`WeightBroadcaster.broadcast`: pause, buckets of
`update_weights_from_distributed` calls with one broadcast per tensor, load into the model, continue). The
baseline: two receiver processes (this script with --receiver) join a plain gloo group with this process and receive
the same tensors, one broadcast per tensor, into preallocated buffers; and the same bytes as one flat buffer.
Rounds alternate between the sides; the best of each counts.

Then delta against full sync (`bench/_delta_link.py`): a 220 MB bf16 model after one AdamW step at lr 1e-6, trainer
and engine in two network namespaces over a 1 Gbit/s link (`tc`), `--delta-rounds` rounds of one full and two delta
syncs each, as xor and as overwrite (best of each; delta_vs_full_sync is the faster encoding's; root only, else
reported as skipped).

Then LoRA against full sync over the same link (`bench/_lora_link.py`): the Qwen3-0.6B shape in bf16 in full against
a rank-16 adapter on every projection (`broadcast_adapter`), `--lora-rounds` rounds (best of each;
lora_vs_full_sync, goal >= 20). A half given 0 rounds is reported as skipped. Prints the tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, print_table, start_engine, start_sync_bench  # noqa: E402
from services.common import procs  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=300)


def receiver(port: int, rank: int, world_size: int, spec_path: str, rounds: int) -> None:
    """A baseline rank: receive every tensor, then the flat buffer, `rounds` times (buffers allocated once)."""
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    store = dist.TCPStore(procs.HOST, port, world_size, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
    buffers = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in spec["tensors"]]
    flat = torch.empty(spec["num_bytes"], dtype=torch.uint8)
    for _ in range(rounds):
        for buffer in buffers:
            group.broadcast([buffer], dist.BroadcastOptions()).wait()
        group.broadcast([flat], dist.BroadcastOptions()).wait()


class RawBroadcast:
    """Rank 0 of the baseline group, with its receiver processes started."""

    def __init__(self, work: Path, tensors: list, num_engines: int, rounds: int) -> None:
        import torch
        import torch.distributed as dist

        self.tensors = tensors
        self.num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        spec = work / "tensors.json"
        spec.write_text(json.dumps({"tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors],
                                    "num_bytes": self.num_bytes}))
        world_size = 1 + num_engines
        self.store = dist.TCPStore(procs.HOST, 0, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        argv = [sys.executable, __file__, "--receiver", str(self.store.port)]
        self.procs = [procs.ManagedProcess(f"receiver-{r}", [*argv, str(r), str(world_size), str(spec), str(rounds)],
                                           work / f"receiver-{r}.log").start() for r in range(1, world_size)]
        self.group = dist.ProcessGroupGloo(self.store, 0, world_size, TIMEOUT)
        self.flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])

    def per_tensor(self) -> None:
        import torch.distributed as dist

        for tensor in self.tensors:
            self.group.broadcast([tensor], dist.BroadcastOptions()).wait()

    def one_buffer(self) -> None:
        import torch.distributed as dist

        self.group.broadcast([self.flat], dist.BroadcastOptions()).wait()

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop(grace_s=30)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        port, rank, world_size, spec, rounds = sys.argv[2:7]
        receiver(int(port), int(rank), int(world_size), spec, int(rounds))
        return 0

    from services.trainer.weight_sync.weight_sync import WeightBroadcaster

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--delta-rounds", type=int, default=2)
    parser.add_argument("--lora-rounds", type=int, default=2)
    args, work, model, weights = start_sync_bench(parser, argv, "physarum-bench-sync-")
    engines = [start_engine(work, model, f"engine-{i}") for i in range(args.engines)]
    raw = RawBroadcast(work, [t for _, t in weights], args.engines, args.rounds)
    times: dict[str, list[float]] = {"physarum": [], "raw": [], "flat": []}
    try:
        with WeightBroadcaster([url for _, url in engines], timeout_s=300.0) as broadcaster:
            broadcaster.init_group()
            for i in range(args.rounds):
                start = time.perf_counter()
                broadcaster.broadcast(weights, f"v{i}")
                times["physarum"].append(time.perf_counter() - start)
                for name, fn in (("raw", raw.per_tensor), ("flat", raw.one_buffer)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
    finally:
        raw.stop()
        for proc, _ in engines:
            proc.stop()
    best = {name: min(values) for name, values in times.items()}
    gb = raw.num_bytes / 1e9
    rows = [[label, f"{best[name]:.3f}", f"{gb / best[name]:.2f}", best["raw"] / best[name]] for label, name in
            (("raw gloo, one broadcast per tensor (baseline)", "raw"), ("raw gloo, one flat buffer", "flat"),
             ("Physarum WeightBroadcaster (SGLang protocol)", "physarum"))]
    print_table(f"weight sync to {args.engines} engines: {len(weights)} tensors, {raw.num_bytes / 1e6:.0f} MB "
                f"(best of {args.rounds})", ["path", "seconds", "GB/s", "baseline time / time (goal >= 0.9)"], rows)
    figures = {"weight_sync_vs_gloo": best["raw"] / best["physarum"], "weight_sync_vs_gloo_flat": best["flat"] /
               best["physarum"], "weight_sync_GBps": gb / best["physarum"]}
    emit({**figures, **delta_figures(work, args.delta_rounds), **lora_figures(work, args.lora_rounds)})
    return 0


def lora_figures(work: Path, rounds: int) -> dict:
    """Full against adapter-only sync over the rate-limited link: a table, and the JSON figures (None where
    skipped)."""
    from bench import _lora_link

    got = _lora_link.measure(work, rounds) if rounds > 0 else {"skipped": "--lora-rounds 0"}
    if "skipped" in got:
        print(f"\nLoRA against full sync skipped: {got['skipped']}\n", flush=True)
        return {"lora_vs_full_sync": None}
    full_s, lora_s = min(got["full_seconds"]), min(got["lora_seconds"])
    print_table(f"weight sync of the Qwen3-0.6B shape in bf16, trainer -> 1 engine over a {_lora_link.LINK_RATE}/s "
                f"link (best of {rounds})",
                ["what is synced", "MB shipped", "seconds", "full time / time (goal >= 20)"],
                [["full weights", got["full_bytes"] / 1e6, full_s, 1.0],
                 [f"LoRA adapter, rank {_lora_link.RANK}, all 7 projections", got["lora_bytes"] / 1e6, lora_s,
                  full_s / lora_s]])
    return {"lora_vs_full_sync": full_s / lora_s, "lora_sync_seconds": lora_s, "lora_sync_bytes": got["lora_bytes"],
            "lora_full_sync_seconds": full_s, "lora_full_sync_bytes": got["full_bytes"]}


def delta_figures(work: Path, rounds: int) -> dict:
    """Full against delta sync over the rate-limited link: a table, and the JSON figures (None where skipped)."""
    from bench import _delta_link

    got = _delta_link.measure(work, rounds) if rounds > 0 else {"skipped": "--delta-rounds 0"}
    if "skipped" in got:
        print(f"\ndelta against full sync skipped: {got['skipped']}\n", flush=True)
        return {"delta_vs_full_sync": None, "delta_changed_fraction": None}
    full_s = min(got["full_seconds"])
    delta_s = {enc: min(got[f"{enc}_seconds"]) for enc in _delta_link.ENCODINGS}
    best = min(delta_s, key=delta_s.get)
    print_table(f"weight sync of a bf16 model ({got['full_bytes'] / 1e6:.0f} MB) after one AdamW step at lr "
                f"{_delta_link.LR:g}, trainer -> 1 engine over a {_delta_link.LINK_RATE}/s link (best of {rounds}); "
                f"{100 * got['changed_fraction']:.2f}% of elements changed",
                ["update_weight_mode", "MB shipped", "seconds", "of which: cast to bf16", "encode",
                 "ship + apply", "CPU seconds (trainer + engine)", "full time / time (goal >= 3)"],
                [[label, got[f"{mode}_bytes"] / 1e6, seconds, got[f"{mode}_phases"][0], got[f"{mode}_phases"][1],
                  seconds - sum(got[f"{mode}_phases"]), got[f"{mode}_cpu_seconds"], full_s / seconds]
                 for label, mode, seconds in [("full", "full", full_s),
                                              *((f"delta, {enc} (zstd, xxh3-128)", enc, delta_s[enc])
                                                for enc in _delta_link.ENCODINGS)]])
    return {"delta_vs_full_sync": full_s / delta_s[best], "delta_encoding": best,
            "delta_changed_fraction": got["changed_fraction"], "full_sync_seconds": full_s,
            "full_sync_bytes": got["full_bytes"], "full_sync_cpu_seconds": got["full_cpu_seconds"],
            **{f"delta_{enc}_seconds": delta_s[enc] for enc in delta_s},
            **{f"delta_{enc}_bytes": got[f"{enc}_bytes"] for enc in delta_s},
            **{f"delta_{enc}_cpu_seconds": got[f"{enc}_cpu_seconds"] for enc in delta_s}}


if __name__ == "__main__":
    sys.exit(main())
