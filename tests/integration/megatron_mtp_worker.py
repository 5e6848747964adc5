"""Two gloo ranks for test_megatron_mtp: a tiny MiMo (testkit/mtp_checkpoints.py) on megatron with its
multi-token-prediction layers, one GRPO rollout (two steps) in each run of RUNS: its steps' metrics, the log-probs
before and after, and the HF export after; at TP 2 also a dist-checkpoint, a second rollout, and that rollout again
from the checkpoint; the MTP layers trained at pipeline parallel size 2 (LAYOUT_RUNS: on the last stage), with untied
and tied embeddings and with uneven stages, and at context parallel size 2, packed and padded, also on the DeepSeek-V3,
each beside its reference at size 1.

Run: python -m tests.integration.megatron_mtp_worker MODELS_DIR OUT_DIR (writes OUT_DIR/results.json; MODELS_DIR holds
the models by the names RUNS and LAYOUT_RUNS give them: one, two (two MTP layers), tied (one's with tied embeddings),
three (three decoder layers), deepseek, qwen3_next and qwen3_5)"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout

WORLD_SIZE = 2
TRAINED = {"mtp_num_layers": 1, "enable_mtp_training": True}
RUNS = {  # name: (model, tensor parallel size, packed, sequence parallel, the config's MTP settings and others)
    "plain": ("one", 1, True, False, {}),  # no MTP layers built: the policy's reference
    "dp2": ("one", 1, True, False, TRAINED),  # 2 data-parallel ranks, packed rows, the fused head
    "dp2_padded_unfused": ("one", 1, False, False, {**TRAINED, "log_probs_chunk_size": -1}),
    "tp2_sp": ("one", 2, True, True, TRAINED),  # slime's MiMo script: TP 2 under sequence parallelism
    "carried": ("one", 1, True, False, {"mtp_num_layers": 1}),  # built, loaded and exported, not trained
    "two_depths": ("two", 1, True, False, {"mtp_num_layers": 2, "enable_mtp_training": True,
                                           "mtp_loss_scaling_factor": 0.5}),
    # DeepSeek-V3: the MTP layer's transformer layer is an MLA and MoE one, as the decoder's last; under routing
    # replay the decoder's routers replay the old policy's experts, the MTP layer's routes as it would
    "deepseek_tp2": ("deepseek", 2, True, False, {**TRAINED, "use_routing_replay": True}),
    "deepseek_carried": ("deepseek", 1, True, False, {"mtp_num_layers": 1}),
    # Qwen3-Next's and Qwen3.5's MTP layer (mtp.*): a full-attention layer after their gated delta-net stack
    "qwen3_next": ("qwen3_next", 1, True, False, TRAINED),
    "qwen3_next_carried": ("qwen3_next", 1, True, False, {"mtp_num_layers": 1}),
    "qwen3_5_tp2": ("qwen3_5", 2, True, False, TRAINED),
}
# MTP layers trained at pipeline parallel size 2 (on the last stage, with its own copy of the embedding) and at context
# parallel size 2 (each rank its slice of every sequence); their references at 1 are dp2 and the two dp2_ runs here
LAYOUT_RUNS = {  # name: (model, the layout: `train`'s keyword arguments)
    "pp2": ("one", {"pp": 2}),  # untied: the copy's gradient summed with the first stage's
    "pp2_tied": ("tied", {"pp": 2}),  # tied: the copy is the output weight too (megatron-core reduces it)
    "dp2_tied": ("tied", {}),
    # uneven stages (slime's --decoder-last-pipeline-num-layers): two decoder layers, then one with the MTP layer
    "pp2_uneven": ("three", {"pp": 2, "megatron_args": {"num_layers_in_last_pipeline_stage": 1}}),
    "dp2_three": ("three", {}),
    "cp2": ("one", {"cp": 2}),
    "cp2_padded": ("one", {"cp": 2, "packed": False}),
    "deepseek_cp2": ("deepseek", {"cp": 2}),  # multi-latent attention and experts, at CP 2
    "deepseek_dp2": ("deepseek", {}),
}


def train(model_dir: Path, *, tp: int = 1, pp: int = 1, cp: int = 1, packed: bool = True,
          sequence_parallel: bool = False, megatron_args: dict | None = None, settings: dict,
          checkpoint: Path | None = None) -> dict:
    """checkpoint: also a dist-checkpoint after the rollout, a second rollout trained, and a fresh backend resumed
    from the checkpoint training that rollout again."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**{**GRPO_CONFIG, **settings}), tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, context_parallel_size=cp, pack_sequences=packed,
                               megatron_args={**(megatron_args or {}), **({"sequence_parallel": True}
                                                                          if sequence_parallel else {})})

    backend = build()
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    before = backend.compute_log_probs(rollout)
    metrics = backend.train_rollout(rollout)
    out = {"log_probs_before": before, "metrics": metrics, "log_probs_after": backend.compute_log_probs(rollout),
           "weights": {name: w.float().tolist() for name, w in backend.named_weights()}}
    if checkpoint is not None:
        backend.save_sharded(checkpoint, 0)
        second = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 1)
        out["second"] = backend.train_rollout(second)
        backend.close()
        backend = build()
        backend.load_sharded(checkpoint)
        out["resumed"] = backend.train_rollout(second)
    backend.close()
    return out


def run(rank: int, world_size: int, models_dir: Path, out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    models = {model.name: model for model in models_dir.iterdir()}
    results = {name: train(models[model], tp=tp, packed=packed, sequence_parallel=sp, settings=settings,
                           checkpoint=out_dir / "ckpt" if name == "tp2_sp" else None)
               for name, (model, tp, packed, sp, settings) in RUNS.items()}
    results.update({name: train(models[model], **layout, settings=TRAINED,
                                checkpoint=out_dir / "ckpt-pp2" if name == "pp2" else None)
                    for name, (model, layout) in LAYOUT_RUNS.items()})
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, *map(Path, sys.argv[1:3]), world_size=WORLD_SIZE,
          start_method="spawn" if torch.cuda.is_available() else "fork")
