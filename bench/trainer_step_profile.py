"""Where a training step's time goes: each backend's step on bench/trainer_throughput.py's long tail, packed and
padded, under torch's profiler, every operator's self time summed into kinds, side by side in one process:

- LM head: the matrix products with a side of the vocabulary's size (the head's forward and both of its gradients),
  run on the positions that predict a response token alone, in both layouts: the same work packed or padded;
- other matrix products (the layers' projections and MLPs): proportional to the row positions, tokens and padding;
- attention: the attention kernels, forward and backward, and the packed rows' tile loop (`varlen`);
- optimizer: AdamW's update and zeroing, and for-each kernels (the gradient norm's own norms count as the rest);
- everything else (norms, activations, copies, the log-softmax's exponentials, autograd's bookkeeping).

CPU: self CPU time (an operator's time less that of the operators it calls); CUDA: each operator's kernels' time on
the card. Milliseconds per step, the mean over --steps profiled steps after two warm-up steps. The "padded / packed"
column is the padded step's time over the packed one's, kind by kind: where the LM head reads about 1, its share of
a step holds the whole step's ratio below that of the rest.

Prints a table per backend, then one JSON line: {"device", "threads", "steps", "ms": {"<backend> <layout>": {kind:
ms, "total": ms}}, "padded_over_packed": {backend: {kind: ratio, "total": ratio}}}.

Run: python -m bench.trainer_step_profile [--device cpu|cuda] [--steps N] [--threads N] [--backends fsdp,megatron]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

KINDS = ("LM head", "other matrix products", "attention", "optimizer", "everything else")
MATRIX_PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
# attention kernels by name on either device, and the autograd node that loops over a packed row's tiles on CPU
ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "flex_attention", "efficient_attention",
                     "cudnn_attention", "varlen_attn", "_CpuFlashTiles")
OPTIMIZER_MARKERS = ("adam", "_foreach_")


def kind_of(name: str, input_shapes: list, vocab_size: int) -> str:
    """The kind of an operator's time (`KINDS`), from its name and, for a matrix product, its operands' shapes."""
    if name in MATRIX_PRODUCTS:
        operands = [shape for shape in input_shapes[:3] if isinstance(shape, list)]
        return "LM head" if any(vocab_size in shape for shape in operands) else "other matrix products"
    if any(marker in name for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in name.lower() for marker in OPTIMIZER_MARKERS):
        return "optimizer"
    return "everything else"


def tally(events: Iterable, vocab_size: int, steps: int, on_device: bool) -> dict[str, float]:
    """Milliseconds per step of each kind (and "total") from the profiler's averages grouped by input shape: self
    CPU time, or (on_device) the time of the kernels each host-side operator launched."""
    ms = dict.fromkeys((*KINDS, "total"), 0.0)
    for event in events:
        micros = event.self_device_time_total if on_device else event.self_cpu_time_total
        if not micros or (on_device and event.device_type != torch.autograd.DeviceType.CPU):
            continue  # on CUDA the kernels' own rows repeat the time their launching operator already holds
        per_step = micros / 1e3 / steps
        ms[kind_of(event.key, event.input_shapes, vocab_size)] += per_step
        ms["total"] += per_step
    return ms


def profile_step(step: Callable[[], None], steps: int, vocab_size: int, device: torch.device) -> dict[str, float]:
    """`step` twice to warm up, then `steps` times under the profiler: milliseconds per step by kind."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return tally(prof.key_averages(group_by_input_shape=True), vocab_size, steps, on_device=device.type == "cuda")


def main(argv: list[str] | None = None) -> dict:
    from bench import trainer_throughput as throughput

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps per run (after two warm-up steps)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument("--backends", default="fsdp,megatron", help="comma-separated: fsdp, megatron")
    args = parser.parse_args(argv)
    builders = {"fsdp": throughput.fsdp_step, "megatron": throughput.megatron_step}
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(builders))
    if unknown or args.steps < 1:
        parser.error(f"unknown backends {unknown}" if unknown else "--steps must be at least 1")
    device = throughput.bench_device(args.device, args.threads)
    dtype = throughput.trainer_dtype(device)
    shape = throughput.SHAPES[device.type]
    vocab_size = shape["model"]["vocab_size"]
    tailed = throughput.long_tailed_samples(shape, vocab_size)
    ms: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = throughput.build_model(Path(tmp) / "model", shape["model"])
        for backend in backends:
            for layout, budget in (("packed", throughput.packed_budget(shape)), ("padded", None)):
                config = throughput.train_config(shape, dtype, len(tailed), budget)
                step = builders[backend](model_dir, tailed, config, device, packed=layout == "packed")
                ms[f"{backend} {layout}"] = profile_step(step, args.steps, vocab_size, device)
                del step
                throughput.release(device)
    tokens = sum(len(s.tokens) for s in tailed)
    clock = "kernel" if device.type == "cuda" else "self CPU"
    print(f"{device.type}, {dtype}, {args.threads if device.type == 'cpu' else 'GPU'} threads; long tail: "
          f"{len(tailed)} samples, {tokens} tokens; ms per step by kind ({clock} time, mean of {args.steps} profiled "
          "steps)")
    ratios = {}
    for backend in backends:
        packed, padded = ms[f"{backend} packed"], ms[f"{backend} padded"]
        ratios[backend] = {kind: round(padded[kind] / packed[kind], 3) for kind in (*KINDS, "total") if packed[kind]}
        print(f"{backend:<22} {'packed':>9} {'padded':>9} {'padded / packed':>16}")
        for kind in (*KINDS, "total"):
            ratio = f"{ratios[backend][kind]:.2f}" if kind in ratios[backend] else "-"
            print(f"{kind:<22} {packed[kind]:>9.1f} {padded[kind]:>9.1f} {ratio:>16}")
    result = {"device": device.type, "threads": args.threads, "steps": args.steps,
              "ms": {run: {kind: round(value, 2) for kind, value in kinds.items()} for run, kinds in ms.items()},
              "padded_over_packed": ratios}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # here, not in main: a test calling main keeps its own logging and warnings
    logging.disable(logging.WARNING)
    main()
