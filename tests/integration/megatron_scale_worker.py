"""Two gloo ranks for test_megatron_scale: megatron-core's optimizer state offloaded to the host and uneven pipeline
stages, each against the plain run on the same GRPO rollouts.

- offload: four GRPO steps at data parallelism 2 (the distributed optimizer shards the state) with
  megatron.optimizer_cpu_offload, with overlap_cpu_optimizer_d2h_h2d, and in bf16 with use_precision_aware_optimizer,
  each beside the same run without offload; the overlapped one is checkpointed after its first rollout and resumed.
- uneven pipeline: a 4-layer Qwen3 at PP=2 with 1 layer on the first stage and 3 on the last, and 3/1, against PP=1.

Run: python -m tests.integration.megatron_scale_worker OUT_DIR  (writes OUT_DIR/results.json)
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import build_tiny_qwen3, spawn
from tests.integration.megatron_worker import GRPO_CONFIG, grpo_rollout

STEP_CONFIG = {**GRPO_CONFIG, "global_batch_size": 4}  # 2 steps a rollout, 4 in all
OFFLOAD_RUNS = {  # name: (bf16, megatron section)
    "fp32": (False, {}),
    "fp32_offload": (False, {"optimizer_cpu_offload": True}),
    "fp32_offload_overlap": (False, {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True}),
    "bf16": (True, {}),
    "bf16_offload_precision_aware": (True, {"optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True,
                                            "use_precision_aware_optimizer": True}),
}
PIPELINES = {  # name: (pp, megatron section)
    "pp1": (1, {}),
    "pp2_first1": (2, {"num_layers_in_first_pipeline_stage": 1}),
    "pp2_last1": (2, {"num_layers_in_last_pipeline_stage": 1}),
}


def train(model_dir: Path, *, bf16: bool = False, pp: int = 1, megatron: dict, ckpt: Path | None = None) -> dict:
    """Two rollouts of two steps: metrics, log-probs after and the HF weights (rank 0). ckpt: saved after the
    first rollout, and a fresh backend resumed from it trains the second again."""
    from services.trainer.backends.base import TrainConfig
    from services.trainer.backends.megatron.backend import MegatronBackend

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**STEP_CONFIG, bf16=bf16), pipeline_model_parallel_size=pp,
                               megatron_args=megatron)

    backend = build()
    rollouts = [grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, r) for r in range(2)]
    before = backend.compute_log_probs(rollouts[0])
    metrics = backend.train_rollout(rollouts[0])
    if ckpt is not None:
        backend.save_sharded(ckpt, rollout_id=0)
    metrics += backend.train_rollout(rollouts[1])
    out = {"metrics": metrics, "log_probs_before": before, "log_probs_after": backend.compute_log_probs(rollouts[0]),
           "weights": {k: v.float().tolist() for k, v in backend.named_weights()},
           "optimizer": _optimizer_kind(backend),
           "stage_layers": [len(backend.arch.stage_layer_range(r, pp)) for r in range(pp)]}
    backend.close()
    if ckpt is not None:
        resumed = build()
        resumed.load_sharded(ckpt)
        out["resumed_metrics"] = resumed.train_rollout(rollouts[1])
        out["resumed_weights"] = {k: v.float().tolist() for k, v in resumed.named_weights()}
        resumed.close()
    return out


def _optimizer_kind(backend) -> dict:
    """Where this rank's optimizer keeps its state: the inner optimizer's class, and for the hybrid optimizer how
    many parameters have host copies and which device its sub-optimizers' state tensors are on."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inner = backend.optimizer.chained_optimizers[0].optimizer
    kind = {"class": type(inner).__name__}
    if isinstance(inner, HybridDeviceOptimizer):
        kind.update(host_copies=len(inner.gpu_params_map_cpu_copy), cpu_optimizers=len(inner.cpu_optimizers),
                    gpu_optimizer=inner.gpu_optimizer is not None,
                    state_devices=sorted({v.device.type for sub in inner.sub_optimizers for s in sub.state.values()
                                          for v in s.values() if torch.is_tensor(v)}))
    return kind


def run(rank: int, world_size: int, out_dir: Path, two_layers: Path, four_layers: Path) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    results: dict[str, dict] = {"offload": {}, "pipeline": {}}
    for name, (bf16, megatron) in OFFLOAD_RUNS.items():
        ckpt = out_dir / "ckpt" if name == "fp32_offload_overlap" else None
        results["offload"][name] = train(two_layers, bf16=bf16, megatron=megatron, ckpt=ckpt)
    for name, (pp, megatron) in PIPELINES.items():
        results["pipeline"][name] = train(four_layers, pp=pp, megatron=megatron)
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    out = Path(sys.argv[1])
    models = [build_tiny_qwen3(out / f"qwen3-{n}", tie_word_embeddings=False, num_layers=n) for n in (2, 4)]
    spawn(run, out, *models, start_method="spawn" if torch.cuda.is_available() else "fork")
