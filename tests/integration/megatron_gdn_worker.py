"""The gated delta-net families' two gloo ranks: `python -m tests.integration.megatron_gdn_worker OUT MODEL_DIR...`
(tiny qwen3_5, qwen3_5_moe and qwen3_next). For each model, MegatronBackend in each of its layouts gives the log-probs
of a GRPO rollout, trains it (two steps) and gives them again; some layouts also save the HF export, one a
dist-checkpoint a fresh backend resumes from; then qwen3_5_moe and qwen3_next train at EP=2 under each kind of routing
replay.
Results go to OUT/results.json for the test to compare with TorchBackend."""

from __future__ import annotations

from pathlib import Path

from tests.integration.family_parity import REPLAY_SETTINGS, layout_run, main, replay_run, run_models

# name -> MegatronBackend's layout on a world of two (the rest data-parallel); rows packed unless said
TP2, PADDED = {"tensor_model_parallel_size": 2}, {"pack_sequences": False}
CP2 = {"context_parallel_size": 2}
LAYOUTS = {"tp1": {}, "tp1_padded": PADDED, "tp2": TP2, "tp2_sp": {**TP2, "megatron_args": {"sequence_parallel": True}},
           "pp2": {"pipeline_model_parallel_size": 2}, "ep2": {"expert_model_parallel_size": 2},
           "tp2_ep2": {**TP2, "expert_model_parallel_size": 2}, "tp2_etp2": {**TP2, "expert_tensor_parallel_size": 2},
           "cp2": CP2, "cp2_padded": {**CP2, **PADDED}}
FAMILY_LAYOUTS = {"qwen3_5": ("tp1", "tp1_padded", "tp2", "tp2_sp", "pp2", "cp2", "cp2_padded"),
                  "qwen3_5_moe": ("tp2", "tp2_sp", "pp2", "ep2", "tp2_ep2", "tp2_etp2"),
                  "qwen3_next": ("tp2", "pp2", "ep2", "tp2_etp2", "cp2")}
EXPORTED = {("qwen3_5", "tp2"), ("qwen3_5_moe", "tp2_ep2"), ("qwen3_next", "tp2")}  # HF exports the test reads
RESUMED = {("qwen3_5_moe", "tp2_ep2")}  # a dist-checkpoint saved and resumed from; a Megatron-LM torch_dist read
REPLAYED = ("qwen3_5_moe", "qwen3_next")  # routed as the fsdp backend replays (their routers: transformers' Qwen ones)


def family_runs(out_dir: Path, model_dir: Path) -> dict:
    """Each layout of the model's family (packed wherever a row can be), then its runs under routing replay."""
    family = model_dir.name
    return {**{layout: layout_run(model_dir, {**LAYOUTS[layout], "min_padding_to_pack": 0.0},
                                  save_dir=out_dir / f"{family}-{layout}" if (family, layout) in EXPORTED else None,
                                  ckpt_dir=out_dir / f"{family}-ckpt" if (family, layout) in RESUMED else None,
                                  job_id="gated-delta-net", torch_dist=True)
               for layout in FAMILY_LAYOUTS[family]},
            **{setting: replay_run(model_dir, setting) for setting in REPLAY_SETTINGS if family in REPLAYED}}


def run(rank: int, world_size: int, out_dir: Path, model_dirs: list[Path]) -> None:
    run_models(rank, out_dir, model_dirs, lambda model_dir: family_runs(out_dir, model_dir))


if __name__ == "__main__":
    main(run)
