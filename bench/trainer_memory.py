"""Peak memory of one fsdp-backend training step with the fused, chunked log-probs (log_probs_chunk_size 1024)
against the logits path (-1), at 1k, 8k and 32k response tokens in one micro-batch.

The model has a vocabulary like Qwen3's (151,936) and a tiny hidden size, so the [tokens × vocab] tensors the logits
path makes dominate, as they do on a real model. Each run is its own process: the model and the rollout are built,
then one train_rollout (forward, backward, optimizer step) is measured. CUDA: torch's peak allocated bytes over the
step; CPU: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs before the step) over its
resident set before it — torch's CPU allocator gives its large tensors back to the system when freed, so the
high-water mark is the step's own peak. A run whose logits would not fit in the memory available is skipped, with
its estimate printed.

Prints a table, then one JSON line: {"device", "vocab", "peak_mib": {"fused_1k": M, "unfused_1k": M, ...},
"logprob_peak_ratio_1k": R, "logprob_peak_ratio_8k": R, "logprob_peak_ratio_32k": R}, R = fused / unfused.

Run: python -m bench.trainer_memory [--device cpu|cuda] [--sizes 1024,8192,32768]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

VOCAB = 151_936
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32)
PROMPT, RESPONSE = 64, 1024  # each sample's tokens: N response tokens are N / 1024 samples
CHUNK = 1024
# bytes per response token per vocabulary entry the logits path keeps at its peak (float32 logits, log-softmax,
# their gradients): the estimate that decides whether a run fits
UNFUSED_BYTES = 4 * 4
# the share of the memory available now a run may be estimated to need: the estimate held within 3% at 1k tokens,
# and a run that still overshoots is the one the kernel ends (oom_score_adj below)
FIT = 0.9


def build_model(out_dir: Path, vocab: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**MODEL, "vocab_size": vocab}, max_position_embeddings=4096, tie_word_embeddings=True,
                         dtype="float32")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def available_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def one_run(model_dir: str, device: str, response_tokens: int, fused: bool, vocab: int) -> int:
    """Peak bytes of one training step (this process)."""
    from services.common.samples import Sample
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    num = response_tokens // RESPONSE
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(tokens=torch.randint(1, vocab, (PROMPT + RESPONSE,), generator=gen).tolist(),
                      response_length=RESPONSE, reward=float(i % 2)) for i in range(num)]
    config = TrainConfig(n_samples_per_prompt=1, global_batch_size=num, micro_batch_size=num, lr=1e-6, bf16=False,
                         log_probs_chunk_size=CHUNK if fused else -1, disable_rewards_normalization=True)
    backend = TorchBackend(model_dir, config, world=World(device=torch.device(device)))
    return peak_bytes(lambda: backend.train_rollout(samples), device)


def _return_free_heap() -> None:
    """glibc's malloc_trim(0): the free memory of every malloc arena back to the OS; nothing where the C library has
    no such call."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def peak_bytes(run: Callable[[], object], device: str) -> int:
    """The most memory `run` held at once beyond what was held before it: on CUDA torch's peak allocated bytes; on
    the CPU the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over its resident set, once
    the heap's free memory went back to the OS (memory freed earlier but still resident would take `run`'s
    allocations without the resident set growing: a 4 MiB mask read 0.1 MiB after other tests in one process)."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    _return_free_heap()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    run()
    return (_status_kib("VmHWM") - before) * 1024


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="1024,8192,32768", help="response tokens per step, multiples of 1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=VOCAB,
                        help="a smaller vocabulary where the logits path at 8k or 32k tokens does not fit (the JSON "
                             "line says which was used)")
    parser.add_argument("--one", nargs=3, metavar=("MODEL_DIR", "TOKENS", "fused|unfused"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.one:
        # this run, not a neighbour, is what the kernel ends if the estimate was short of the truth
        Path("/proc/self/oom_score_adj").write_text("1000")
        model_dir, tokens, kind = args.one
        print(json.dumps({"peak_bytes": one_run(model_dir, args.device, int(tokens), kind == "fused", args.vocab)}))
        return {}
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(n % RESPONSE or n <= 0 for n in sizes):
        parser.error(f"--sizes: each a positive multiple of {RESPONSE}")
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(Path(tmp) / "model", args.vocab))
        for tokens in sizes:
            for kind in ("fused", "unfused"):
                name = f"{kind}_{tokens // 1024}k"
                need = tokens * args.vocab * UNFUSED_BYTES if kind == "unfused" else tokens * 64 * 1024
                if need > (have := available_bytes(args.device)) * FIT:
                    print(f"{name}: skipped, needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available")
                    continue
                out = subprocess.run([sys.executable, "-m", "bench.trainer_memory", "--device", args.device,
                                      "--threads", str(args.threads), "--vocab", str(args.vocab),
                                      "--one", model_dir, str(tokens), kind],
                                     capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                                     timeout=3600)
                if out.returncode:
                    print(f"{name}: failed\n{out.stderr[-2000:]}")
                    continue
                peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
                print(f"{name:<14} peak {peaks[name] / 2**20:>9.0f} MiB", flush=True)
    result: dict = {"device": args.device, "vocab": args.vocab,
                    "peak_mib": {k: round(v / 2**20, 1) for k, v in peaks.items()}}
    for tokens in sizes:
        k = f"{tokens // 1024}k"
        if f"fused_{k}" in peaks and f"unfused_{k}" in peaks:
            result[f"logprob_peak_ratio_{k}"] = round(peaks[f"fused_{k}"] / peaks[f"unfused_{k}"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
