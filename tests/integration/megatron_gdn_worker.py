"""The gated delta-net families' two gloo ranks: `python -m tests.integration.megatron_gdn_worker OUT MODEL_DIR...`
(tiny qwen3_5, qwen3_5_moe and qwen3_next). For each model, MegatronBackend in each of its layouts gives the log-probs
of a GRPO rollout, trains it (two steps) and gives them again; some layouts also save the HF export, one a
dist-checkpoint a fresh backend resumes from; then qwen3_5_moe and qwen3_next train at EP=2 under each kind of routing
replay.
Results go to OUT/results.json for the test to compare with TorchBackend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from tests.integration.megatron_moe_families_worker import REPLAY_SETTINGS, replay_run

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


def save_torch_dist(gpt, root: Path) -> None:
    """Collective: Megatron-LM's save of the model, {root}/release by dist_checkpointing.save and the latest file."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        (root / "release").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": gpt.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0},
                            str(root / "release"))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()


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

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), min_padding_to_pack=0.0, **LAYOUTS[layout])

    backend = build()
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    before = backend.compute_log_probs(rollout)
    metrics = _metrics(backend, rollout)
    after = backend.compute_log_probs(rollout)
    if save_dir is not None:
        backend.save_hf(save_dir)
    out = {"log_probs_before": before, "metrics": metrics, "log_probs_after": after}
    if ckpt_dir is not None:
        torch_dist = ckpt_dir.with_name(ckpt_dir.name + "-torch-dist")  # Megatron-LM's save (slime's --load)
        save_torch_dist(backend.gpt, torch_dist)
        world = World(rank=dist.get_rank(), world_size=dist.get_world_size())
        iterations.save_checkpoint(ckpt_dir, 0, backend, world, lambda: iterations.TrainerState(
            rollout_id=0, job_id="gated-delta-net", world_size=world.world_size))
        second = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 1)
        out["second_metrics"] = _metrics(backend, second)
        backend.close()
        backend = build()
        iterations.load_checkpoint(ckpt_dir, backend, world)
        out["resumed_metrics"] = _metrics(backend, second)
        backend.close()
        backend = build()
        backend.load_megatron_checkpoint(iterations.slime_checkpoint(torch_dist), "model")
        out["torch_dist_log_probs"] = backend.compute_log_probs(rollout)
    backend.close()
    return out


def run(rank: int, world_size: int, out_dir: Path, model_dirs: list[Path]) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    results = {}
    for model_dir in model_dirs:
        family = model_dir.name
        results[family] = {
            layout: layout_run(model_dir, layout,
                               out_dir / f"{family}-{layout}" if (family, layout) in EXPORTED else None,
                               out_dir / f"{family}-ckpt" if (family, layout) in RESUMED else None)
            for layout in FAMILY_LAYOUTS[family]}
        if family in REPLAYED:
            results[family].update({setting: replay_run(model_dir, setting) for setting in REPLAY_SETTINGS})
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]],
          start_method="spawn" if torch.cuda.is_available() else "fork")
