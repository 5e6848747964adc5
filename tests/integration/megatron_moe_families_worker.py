"""The sigmoid-routed MoE families' two gloo ranks: `python -m tests.integration.megatron_moe_families_worker OUT
MODEL_DIR...` (tiny deepseek_v3, glm4_moe_lite, glm4_moe and minimax_m2; the dense glm4 at TP=2 and PP=2 only, and
glm_moe_dsa at TP=2, PP=2 and EP=2, and under routing replay).
For each model, MegatronBackend in every layout of LAYOUTS gives the log-probs of a GRPO rollout, trains it (two
steps) and gives them again; the EP=2 and expert-TP=2 layouts also save their HF export, the TP=2 × EP=2 one a dist-
checkpoint it resumes from; then at EP=2 it trains under each kind of routing replay. Results go to OUT/results.json
for the test to compare with TorchBackend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from tests.integration.megatron_moe_worker import engine_routed
from tests.integration.megatron_worker import GRPO_CONFIG, grpo_rollout

# name -> (tensor, pipeline, expert, expert tensor) parallel sizes on a world of two; the rest is data-parallel
LAYOUTS = {"tp2": (2, 1, 1, 1), "pp2": (1, 2, 1, 1), "ep2": (1, 1, 2, 1), "tp2_ep2": (2, 1, 2, 1),
           "tp2_etp2": (2, 1, 1, 2)}
EXPORTED = ("ep2", "tp2_etp2")  # the layouts whose HF export the test reads
REPLAY_SETTINGS = ("use_routing_replay", "use_rollout_routing_replay")
DENSE_LAYOUTS = ("tp2", "pp2")  # a dense family's (GLM-4): no experts to spread, route or replay
SPARSE_LAYOUTS = ("tp2", "pp2", "ep2")  # GLM-5's (DeepSeek sparse attention over MLA, DeepSeek-V3's MoE)
# the families whose routing replay the test compares with the fsdp backend's (which patches their routers; MiniMax-M2
# keeps its expert bias outside its router, which the fsdp backend does not replay)
REPLAYED = ("deepseek_v3", "glm4_moe_lite", "glm4_moe", "glm_moe_dsa")


def _metrics(backend, rollout) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]


def layout_run(model_dir: Path, layout: str, save_dir: Path | None, ckpt_dir: Path | None) -> dict:
    """One rollout's log-probs, steps and log-probs after in `layout`; save_dir: the HF export then; ckpt_dir: a
    dist-checkpoint then, a second rollout trained, and a fresh backend resumed from the checkpoint training it
    again."""
    import torch.distributed as dist

    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    tp, pp, ep, etp = LAYOUTS[layout]

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp)

    backend = build()
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    before = backend.compute_log_probs(rollout)
    metrics = _metrics(backend, rollout)
    after = backend.compute_log_probs(rollout)
    if save_dir is not None:
        backend.save_hf(save_dir)
    out = {"log_probs_before": before, "metrics": metrics, "log_probs_after": after}
    if ckpt_dir is not None:
        world = World(rank=dist.get_rank(), world_size=dist.get_world_size())
        iterations.save_checkpoint(ckpt_dir, 0, backend, world, lambda: iterations.TrainerState(
            rollout_id=0, job_id="moe-families", world_size=world.world_size))
        second = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 1)
        out["second_metrics"] = _metrics(backend, second)
        backend.close()
        backend = build()
        iterations.load_checkpoint(ckpt_dir, backend, world)
        out["resumed_metrics"] = _metrics(backend, second)
    backend.close()
    return out


def replay_run(model_dir: Path, setting: str) -> dict:
    """One rollout at EP=2 under `setting`, routed to an engine's other experts (use_rollout_routing_replay) or to
    the experts the old policy's forward chose (use_routing_replay)."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG, **{setting: True}), expert_model_parallel_size=2)
    rollout = engine_routed(model_dir, grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0))
    metrics = _metrics(backend, rollout)
    after = backend.compute_log_probs(rollout)
    backend.close()
    return {"metrics": metrics, "log_probs_after": after}


def run(rank: int, world_size: int, out_dir: Path, model_dirs: list[Path]) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    results = {}
    for model_dir in model_dirs:
        if model_dir.name == "glm4":
            results[model_dir.name] = {layout: layout_run(model_dir, layout, None, None) for layout in DENSE_LAYOUTS}
            continue
        if model_dir.name == "glm_moe_dsa":
            results[model_dir.name] = {
                **{layout: layout_run(model_dir, layout, out_dir / f"{model_dir.name}-{layout}"
                                      if layout in EXPORTED else None, None) for layout in SPARSE_LAYOUTS},
                **{setting: replay_run(model_dir, setting) for setting in REPLAY_SETTINGS}}
            continue
        results[model_dir.name] = {
            **{layout: layout_run(model_dir, layout, out_dir / f"{model_dir.name}-{layout}" if layout in EXPORTED
                                  else None,
                                  out_dir / f"{model_dir.name}-ckpt" if layout == "tp2_ep2" else None)
               for layout in LAYOUTS},
            **{setting: replay_run(model_dir, setting) for setting in REPLAY_SETTINGS
               if model_dir.name in REPLAYED}}
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]],
          start_method="spawn" if torch.cuda.is_available() else "fork")
