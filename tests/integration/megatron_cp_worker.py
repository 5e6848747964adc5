"""Four gloo ranks for test_megatron_context_parallel: one GRPO rollout (two steps) of a tiny Qwen3 and a tiny
Qwen3-MoE on megatron at context parallelism 1 and 2, with tensor parallelism 1 and 2, packed (THD) and as padded
rectangles, under sequence parallelism, and with slime's mismatch example's mis.py as the TIS function; the
log-probs before and after, the steps' metrics, the last step's gradient of every parameter (HF names, whole) and
the weights after.

Run: python -m tests.integration.megatron_cp_worker DENSE_DIR MOE_DIR MLA_DIR OUT_DIR  (writes OUT_DIR/results.json;
MLA_DIR: a tiny DeepSeek-V3 with an MTP layer, trained at TP 2 × CP 2 under sequence parallelism)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from tests.integration.megatron_worker import GRPO_CONFIG, grpo_rollout

WORLD_SIZE = 4
CONFIG = {**GRPO_CONFIG, "micro_batch_size": 2}
RUNS = {  # name: (model, tp, cp, packed, sequence parallel)
    **{f"dense_tp{tp}_cp{cp}_packTrue": ("dense", tp, cp, True, False) for tp in (1, 2) for cp in (1, 2)},
    **{f"dense_tp1_cp{cp}_packFalse": ("dense", 1, cp, False, False) for cp in (1, 2)},
    **{f"dense_tp2_cp2_sp_pack{packed}": ("dense", 2, 2, packed, True) for packed in (True, False)},
    **{f"moe_tp1_cp{cp}_packTrue": ("moe", 1, cp, True, False) for cp in (1, 2)},
    # mis.py normalizes its weights over each micro-batch: both runs deal the rows to 2 data-parallel ranks alike
    **{f"mis_tp{tp}_cp{cp}_packTrue": ("dense", tp, cp, True, False) for tp, cp in ((2, 1), (1, 2))},
    # GLM-4.7-Flash's script's layout on a tiny DeepSeek-V3 (multi-latent attention, experts): TP 2 under sequence
    # parallelism at CP 2, its MTP layer trained
    "mla_tp1_cp1_packTrue": ("mla", 1, 1, True, False), "mla_tp2_cp2_sp_packTrue": ("mla", 2, 2, True, True),
}
MTP = {"mtp_num_layers": 1, "enable_mtp_training": True}  # the mla runs'

SLIME_EXAMPLES = Path(__file__).resolve().parents[1] / "slime_examples"  # slime's root: examples.*
MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def mis_config() -> dict:
    """slime's train-inference mismatch example: its mis.py as the TIS function, its mis.yaml as slime's args."""
    import yaml

    args = yaml.safe_load((SLIME_EXAMPLES / "examples" / "train_infer_mismatch_helper" / "mis.yaml").read_text())
    return {**CONFIG, "use_tis": True, "custom_tis_function_path": MIS, "args": args}


def train(model_dir: Path, *, tp: int, cp: int, packed: bool, sequence_parallel: bool, config: dict) -> dict:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint import megatron_convert as convert
    from services.trainer.settings.train import TrainConfig

    # the plain optimizer: every rank holds its parameters' whole reduced gradient after the step
    backend = MegatronBackend(model_dir, TrainConfig(**config), tensor_model_parallel_size=tp,
                              context_parallel_size=cp, pack_sequences=packed, use_distributed_optimizer=False,
                              megatron_args={"sequence_parallel": True} if sequence_parallel else None)
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    before = backend.compute_log_probs(rollout)
    metrics = backend.train_rollout(rollout)
    grads = convert.gather_hf_weights(
        [(name, _grad_of(param)) for name, param in backend.gpt.named_parameters()], backend.arch,
        tp_group=backend.tp_group, tp_rank=backend.tp_rank, tp_size=backend.tp_size, pp_group=backend.pp_group,
        pp_rank=backend.pp_rank, pp_size=backend.pp_size, dp_rank=backend.dp_cp_rank)
    out = {"log_probs_before": before, "metrics": metrics,
           "grads": {name: grad.float().tolist() for name, grad in grads},
           "log_probs_after": backend.compute_log_probs(rollout),
           "weights": {name: w.float().tolist() for name, w in backend.named_weights()}}
    backend.close()
    return out


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter's reduced gradient, marked tensor-parallel as the parameter is (the gather over TP reads it)."""
    from megatron.core import tensor_parallel

    grad = param.main_grad.detach().clone()
    tensor_parallel.copy_tensor_model_parallel_attributes(grad, param)
    return grad


def run(rank: int, world_size: int, dense_dir: Path, moe_dir: Path, mla_dir: Path, out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    models = {"dense": dense_dir, "moe": moe_dir, "mla": mla_dir}
    results = {name: train(models[model], tp=tp, cp=cp, packed=packed, sequence_parallel=sp,
                           config=mis_config() if name.startswith("mis") else {**CONFIG, **MTP} if model == "mla"
                           else CONFIG)
               for name, (model, tp, cp, packed, sp) in RUNS.items()}
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401
    from services.common.plugins import ALLOWLIST_ENV

    sys.path.insert(0, str(SLIME_EXAMPLES))  # as slime's launch scripts put its root on PYTHONPATH
    os.environ[ALLOWLIST_ENV] = "examples.train_infer_mismatch_helper"
    spawn(run, *map(Path, sys.argv[1:5]), world_size=WORLD_SIZE,
          start_method="spawn" if torch.cuda.is_available() else "fork")
