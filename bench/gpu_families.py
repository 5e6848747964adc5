"""The model families on CUDA (part of `make gpu-check`): a tiny MoE (qwen3_moe) and a tiny Qwen3.5 (gated
delta-net linear attention, torch's fallback kernels) each train one GRPO rollout with the fsdp backend on CUDA and on
the CPU, float32 with TF32 off: losses equal within 1e-5, log-probs within 1e-4; bf16 on CUDA reported beside them.

Run: python -m bench.gpu_families   (on a machine without CUDA it compares the CPU with itself, as a smoke test)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from bench._precision import precision_rows

FAMILIES = ("qwen3_moe", "qwen3_5")


def grpo_rollout(model_dir: Path, device: torch.device, bf16: bool) -> dict:
    """Two rollouts of the parity tests' GRPO setting on `device`; their metrics and the first rollout's log-probs."""
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig
    from testkit.grpo_rollout import GRPO_CONFIG
    from testkit.grpo_rollout import grpo_rollout as fixed_rollout

    backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, bf16=bf16, allow_tf32=False),
                           world=World(device=device))
    rollouts = [fixed_rollout(backend.model.config.vocab_size, backend.pad_token_id, r) for r in range(2)]
    metrics = [m for rollout in rollouts for m in backend.train_rollout(rollout)]
    return {"metrics": metrics, "log_probs": backend.compute_log_probs(rollouts[0])}


def family_rows(tmp: Path) -> list[tuple[str, bool, str]]:
    from physarum import tasks, tinymodel

    cuda = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for family in FAMILIES:
        model_dir = tinymodel.build_tiny_model(tmp / family, tasks.corpus(), hidden_size=64, family=family)
        cpu = grpo_rollout(model_dir, torch.device("cpu"), bf16=False)
        fp32, bf16 = grpo_rollout(model_dir, cuda, bf16=False), grpo_rollout(model_dir, cuda, bf16=True)
        rows += precision_rows(f"fsdp {family}: fp32 {cuda.type} vs CPU",
                               f"fsdp {family}: bf16 on {cuda.type} (reported)", cpu, fp32, bf16)
    return rows


def main() -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        rows = family_rows(Path(tmp))
    for name, ok, detail in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print(json.dumps({"families": {name: {"ok": ok, "detail": detail} for name, ok, detail in rows}}))
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
