"""One process, a world of one: MegatronBackend's first GRPO rollout in float32 and in bf16 on the same data, for
test_precision; the float32 run under the device check (tests/device_check.py: every tensor the project creates
names its device). Run: python -m tests.integration.precision_worker OUT_DIR  (writes OUT_DIR/results.json)"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import build_tiny_qwen3
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from tests.device_check import SameDevice


def run(model_dir: Path, bf16: bool) -> dict:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG, bf16=bf16))
    samples = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id)
    main_dtypes = {str(p.dtype) for o in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
                   for g in o.optimizer.param_groups for p in g["params"]}
    with SameDevice(named_factories=not bf16) as check:
        out = {"param_dtypes": sorted({str(p.dtype) for p in backend.gpt.parameters()}),
               "main_param_dtypes": sorted(main_dtypes), "metrics": backend.train_rollout(samples),
               "log_probs": backend.compute_log_probs(samples), "num_checked": check.num_checked}
    backend.close()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    out_dir = Path(sys.argv[1])
    model = build_tiny_qwen3(out_dir / "model", tie_word_embeddings=True)
    results = {"fp32": run(model, False), "bf16": run(model, True)}
    (out_dir / "results.json").write_text(json.dumps(results))
