"""Two gloo ranks for test_megatron_scale: megatron-core's optimizer state offloaded to the host and uneven pipeline
stages, each against the plain run on the same GRPO rollouts; PPO's critic and every advantage estimator, for the
test to hold against the fsdp backend's.

- offload: four GRPO steps at data parallelism 2 (the distributed optimizer shards the state) with
  megatron.optimizer_cpu_offload, with overlap_cpu_optimizer_d2h_h2d, and in bf16 with use_precision_aware_optimizer,
  each beside the same run without offload; the overlapped one is checkpointed after its first rollout and resumed.
- uneven pipeline: a 4-layer Qwen3 at PP=2 with 1 layer on the first stage and 3 on the last, and 3/1, against PP=1.
- estimators: one rollout of each advantage estimator at data parallelism 2 (PPO with its critic).
- PPO: two rollouts (the first trains the critic alone) at TP=2 and at PP=2, the TP=2 one checkpointed after its
  first rollout and resumed.

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
ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
PPO_LAYOUTS = {"ppo_tp2": (2, 1), "ppo_pp2": (1, 2)}  # name: (tp, pp)


def estimator_config(estimator: str, **extra) -> dict:
    """A step config per estimator: KL as reward shaping where slime's estimator uses it (ppo, reinforce++), else
    as a loss; reinforce++ whitens its advantages (slime requires it)."""
    config = {k: v for k, v in STEP_CONFIG.items() if k not in ("use_kl_loss", "kl_loss_coef", "use_tis")}
    if estimator in ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        config["kl_coef"] = 0.05
    else:
        config.update(use_kl_loss=True, kl_loss_coef=0.1, use_tis=True)
    if estimator.startswith("reinforce"):
        config["normalize_advantages"] = True
    return {**config, "advantage_estimator": estimator, "n_samples_per_prompt": 2, **extra}


PIPELINES = {  # name: (pp, megatron section)
    "pp1": (1, {}),
    "pp2_first1": (2, {"num_layers_in_first_pipeline_stage": 1}),
    "pp2_last1": (2, {"num_layers_in_last_pipeline_stage": 1}),
}


def train(model_dir: Path, *, bf16: bool = False, tp: int = 1, pp: int = 1, megatron: dict | None = None,
          ckpt: Path | None = None, config: dict | None = None, num_rollouts: int = 2) -> dict:
    """Rollouts of two steps: metrics, log-probs after and the HF weights (rank 0). ckpt: saved after the first
    rollout, and a fresh backend resumed from it trains the second again."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**(config or STEP_CONFIG), bf16=bf16),
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, megatron_args=megatron)

    backend = build()
    rollouts = [grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, r) for r in range(num_rollouts)]
    before = backend.compute_log_probs(rollouts[0])
    metrics = backend.train_rollout(rollouts[0])
    if ckpt is not None:
        backend.save_sharded(ckpt, rollout_id=0)
    for rollout in rollouts[1:]:
        metrics += backend.train_rollout(rollout)
    out = {"metrics": metrics, "log_probs_before": before, "log_probs_after": backend.compute_log_probs(rollouts[0]),
           "weights": {k: v.float().tolist() for k, v in backend.named_weights()},
           "optimizer": _optimizer_kind(backend),
           "stage_layers": [len(backend.arch.stage_layer_range(r, pp)) for r in range(pp)]}
    backend.close()
    if ckpt is not None:
        resumed = build()
        out["resumed_parts"] = sorted(resumed.load_sharded(ckpt))
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
    results: dict[str, dict] = {"offload": {}, "pipeline": {}, "estimators": {}, "ppo": {}}
    for name, (bf16, megatron) in OFFLOAD_RUNS.items():
        ckpt = out_dir / "ckpt" if name == "fp32_offload_overlap" else None
        results["offload"][name] = train(two_layers, bf16=bf16, megatron=megatron, ckpt=ckpt)
    for name, (pp, megatron) in PIPELINES.items():
        results["pipeline"][name] = train(four_layers, pp=pp, megatron=megatron)
    for estimator in ESTIMATORS:
        results["estimators"][estimator] = train(two_layers, config=estimator_config(estimator), num_rollouts=1)
    for name, (tp, pp) in PPO_LAYOUTS.items():
        ckpt = out_dir / "ppo-ckpt" if name == "ppo_tp2" else None
        results["ppo"][name] = train(two_layers, tp=tp, pp=pp, ckpt=ckpt,
                                     config=estimator_config("ppo", num_critic_only_steps=1))
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
