"""The sigmoid-routed MoE families' two gloo ranks: `python -m tests.integration.megatron_moe_families_worker OUT
MODEL_DIR...` (tiny deepseek_v3, glm4_moe_lite, glm4_moe and minimax_m2; the dense glm4 at TP=2 and PP=2 only, and
glm_moe_dsa at TP=2, PP=2 and EP=2, and under routing replay).
For each model, MegatronBackend in every layout of LAYOUTS gives the log-probs of a GRPO rollout, trains it (two
steps) and gives them again; the EP=2 and expert-TP=2 layouts also save their HF export, the TP=2 × EP=2 one a dist-
checkpoint it resumes from; then at EP=2 it trains under each kind of routing replay. Results go to OUT/results.json
for the test to compare with TorchBackend."""

from __future__ import annotations

from pathlib import Path

from tests.integration.family_parity import REPLAY_SETTINGS, layout_run, main, replay_run, run_models

# name -> (tensor, pipeline, expert, expert tensor) parallel sizes on a world of two; the rest is data-parallel
LAYOUTS = {"tp2": (2, 1, 1, 1), "pp2": (1, 2, 1, 1), "ep2": (1, 1, 2, 1), "tp2_ep2": (2, 1, 2, 1),
           "tp2_etp2": (2, 1, 1, 2)}
EXPORTED = ("ep2", "tp2_etp2")  # the layouts whose HF export the test reads
DENSE_LAYOUTS = ("tp2", "pp2")  # a dense family's (GLM-4): no experts to spread, route or replay
SPARSE_LAYOUTS = ("tp2", "pp2", "ep2")  # GLM-5's (DeepSeek sparse attention over MLA, DeepSeek-V3's MoE)
# the families whose routing replay the test compares with the fsdp backend's (which patches their routers; MiniMax-M2
# keeps its expert bias outside its router, which the fsdp backend does not replay)
REPLAYED = ("deepseek_v3", "glm4_moe_lite", "glm4_moe", "glm_moe_dsa")


def backend_layout(sizes: tuple[int, int, int, int]) -> dict:
    """MegatronBackend's keyword arguments for (tensor, pipeline, expert, expert tensor) parallel sizes."""
    tp, pp, ep, etp = sizes
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp}


def family_runs(out_dir: Path, model_dir: Path) -> dict:
    """Every layout of the model's family (the HF export in EXPORTED ones, a dist-checkpoint at TP=2 × EP=2 for the
    MoE families in every layout), then its runs under routing replay."""
    family = model_dir.name
    layouts = DENSE_LAYOUTS if family == "glm4" else SPARSE_LAYOUTS if family == "glm_moe_dsa" else LAYOUTS
    resumed = family not in ("glm4", "glm_moe_dsa")
    return {**{layout: layout_run(model_dir, backend_layout(LAYOUTS[layout]),
                                  save_dir=out_dir / f"{family}-{layout}" if layout in EXPORTED else None,
                                  ckpt_dir=out_dir / f"{family}-ckpt" if resumed and layout == "tp2_ep2" else None,
                                  job_id="moe-families")
               for layout in layouts},
            **{setting: replay_run(model_dir, setting) for setting in REPLAY_SETTINGS if family in REPLAYED}}


def run(rank: int, world_size: int, out_dir: Path, model_dirs: list[Path]) -> None:
    run_models(rank, out_dir, model_dirs, lambda model_dir: family_runs(out_dir, model_dir))


if __name__ == "__main__":
    main(run)
