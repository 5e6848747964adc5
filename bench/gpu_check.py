"""The GPU check (`make gpu-check`): what only a CUDA machine can confirm, in one run, with a table of results.

1. Both backends' GRPO steps on CUDA against the same steps on CPU, float32 with TF32 off: losses equal within
   1e-5, log-probs within 1e-4; bf16 on CUDA reported next to them.
   The same for a tiny MoE (qwen3_moe) and a tiny Qwen3.5 on the fsdp backend (bench/gpu_families.py).
2. With two GPUs: the NCCL weight sync's failure case, the launcher and the bf16 tests.
3. The demo with the trainer and a CPU engine on the GPU (`physarum.demo --device cuda --engine-device cuda`).
4. The throughput rows (bench/trainer_throughput.py) in bf16 and float32: each backend against the plain loop, and
   the packed step against padded and against the plain loop on long-tailed responses, with tokens/s and MFU.
5. Packed rows' attention through the real CUDA kernels (varlen flash in bf16, compiled flex attention in float32)
   against one attention per sequence, and the peak memory of a training step with the fused log-probs against the
   logits path (bench/trainer_memory.py).

On a machine without CUDA it says so and exits 0. Each part runs in its own process (Megatron takes every visible
GPU, so the CPU runs hide them). Exit status 1 when a part fails.
Run: python -m bench.gpu_check [--skip-demo] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench import gpu_families
from bench._precision import precision_rows

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout_s)


def grpo_steps(out: Path, backend: str, bf16: bool) -> None:
    """This process's device: one GRPO rollout (two optimizer steps, KL to a reference) of `backend`; writes JSON."""
    import logging
    import warnings

    from bench.megatron_parity import build_tiny_qwen3
    from services.trainer.settings.train import TrainConfig
    from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    model_dir = build_tiny_qwen3(out.parent / "model", tie_word_embeddings=True)
    config = TrainConfig(**GRPO_CONFIG, bf16=bf16, allow_tf32=False)
    if backend == "fsdp":
        from services.trainer.backends.fsdp.backend import TorchBackend
        from services.trainer.distributed.parallel import World

        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        model = TorchBackend(model_dir, config, world=World(device=device))
        vocab, pad = model.model.config.vocab_size, model.pad_token_id
    else:
        from services.trainer.backends.megatron.backend import MegatronBackend

        model = MegatronBackend(model_dir, config)
        vocab, pad = model.arch.vocab_size, model.pad_token_id
    rollouts = [grpo_rollout(vocab, pad, r) for r in range(2)]
    metrics = [m for rollout in rollouts for m in model.train_rollout(rollout)]
    result = {"metrics": metrics, "log_probs": model.compute_log_probs(rollouts[0]),
              "device": str(getattr(model, "device", "")), "dtype": str(model.dtype)}
    out.write_text(json.dumps(result))


def parity(tmp: Path) -> list[tuple[str, bool, str]]:
    rows = []
    for backend in ("fsdp", "megatron"):
        results = {}
        for name, env, bf16 in (("cpu", {"CUDA_VISIBLE_DEVICES": ""}, False), ("cuda", {}, False),
                                ("cuda-bf16", {}, True)):
            out = tmp / f"{backend}-{name}" / "steps.json"
            out.parent.mkdir(parents=True)
            proc = run(["-m", "bench.gpu_check", "--steps", str(out), "--backend", backend, "--bf16", str(bf16)],
                       env=env)
            if proc.returncode:
                rows.append((f"{backend} GRPO steps ({name})", False, proc.stderr.strip()[-400:]))
                break
            results[name] = json.loads(out.read_text())
        if len(results) < 3:
            continue
        cpu, cuda, bf16 = results["cpu"], results["cuda"], results["cuda-bf16"]
        rows += precision_rows(f"{backend}: fp32 CUDA vs CPU ({cuda['device']})", f"{backend}: bf16 on CUDA (reported)",
                               cpu, cuda, bf16)
    return rows


def two_gpus() -> tuple[str, bool, str]:
    if (count := torch.cuda.device_count()) < 2:
        return ("NCCL weight sync failure (two GPUs)", True, f"skipped: {count} GPU visible, 2 needed")
    proc = run(["-m", "pytest", "-q", "-x", "tests/integration/test_weight_sync_nccl.py",
                "tests/integration/test_launch.py", "tests/integration/test_precision.py"])
    return ("NCCL weight sync failure, launcher, bf16 tests", proc.returncode == 0,
            proc.stdout.strip().splitlines()[-1])


def demo() -> tuple[str, bool, str]:
    proc = run(["-m", "physarum.demo", "--device", "cuda", "--engine-device", "cuda"], timeout_s=900)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return ("demo, trainer and engine on the GPU", proc.returncode == 0, " | ".join(lines[-3:])[-400:])


def throughput() -> list[tuple[str, bool, str]]:
    """bench/trainer_throughput.py per dtype, a row from its JSON line each: the backends against the plain loop on
    equal lengths, then the packed step against padded and against the plain loop on long-tailed responses."""
    rows = []
    for dtype in ("bfloat16", "float32"):
        proc = run(["-m", "bench.trainer_throughput", "--device", "cuda", "--dtype", dtype, "--rounds", "3"])
        if proc.returncode != 0:
            rows.append((f"throughput {dtype}", False, proc.stderr.strip()[-400:]))
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((f"throughput {dtype}", True, f"vs the plain loop, equal lengths: fsdp {r['fsdp']:.2f}×, "
                                                  f"megatron {r['megatron']:.2f}×"))
        rows.append((f"packed step {dtype}", True,
                     f"long-tailed responses, packed vs padded: fsdp {r['packed_vs_padded_fsdp']:.2f}×, megatron "
                     f"{r['packed_vs_padded_megatron']:.2f}×; vs the plain loop: fsdp {r['packed_vs_plain_fsdp']:.2f}×,"
                     f" megatron {r['packed_vs_plain_megatron']:.2f}×"))
    return rows


def kernels_and_memory() -> list[tuple[str, bool, str]]:
    proc = run(["-m", "pytest", "-q", "-rs", "-s", "tests/unit/test_varlen_kernels.py"])
    kernels = " ".join(line for line in proc.stdout.splitlines() if line.startswith("torch."))
    rows = [("varlen kernels on CUDA", proc.returncode == 0 and "skipped" not in proc.stdout.splitlines()[-1],
             f"{kernels} | {proc.stdout.strip().splitlines()[-1]}")]
    proc = run(["-m", "bench.trainer_memory", "--device", "cuda"], timeout_s=900)
    if proc.returncode:
        return [*rows, ("fused log-probs memory", False, proc.stderr.strip()[-400:])]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    ratio = r.get("logprob_peak_ratio_8k")
    return [*rows, ("fused log-probs memory", ratio is not None and ratio <= 0.25,
                    f"fused / logits path peak: {', '.join(f'{k}: {v}' for k, v in r.items() if 'ratio' in k)}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--steps", type=Path, help=argparse.SUPPRESS)  # one part: GRPO steps on this device
    parser.add_argument("--backend", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", default="False", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps:
        grpo_steps(args.steps, args.backend, args.bf16 == "True")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no GPU (torch sees no CUDA device): nothing to check here; run it on a CUDA machine")
        return 0
    print(f"gpu-check on {torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}, torch {torch.__version__}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = parity(Path(tmp))
        rows.extend(gpu_families.family_rows(Path(tmp) / "families"))
    rows.extend(kernels_and_memory())
    rows.append(two_gpus())
    if not args.skip_demo:
        rows.append(demo())
    if not args.skip_throughput:
        rows.extend(throughput())
    for name, ok, detail in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
