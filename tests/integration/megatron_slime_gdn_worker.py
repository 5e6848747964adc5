"""Two gloo ranks at TP=2: `python -m tests.integration.megatron_slime_gdn_worker OUT HF_DIR SLIME_ROOT`: a
MegatronBackend of HF_DIR's architecture loads slime's torch_dist under SLIME_ROOT (each rank its own shards, as
slime's --load) and writes its HF export to OUT/hf for the test to compare."""

from __future__ import annotations

from pathlib import Path

from tests.integration.family_parity import main


def run(rank: int, world_size: int, out_dir: Path, paths: list[Path]) -> None:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint.iterations import slime_checkpoint
    from services.trainer.settings.train import TrainConfig

    hf_dir, root = paths
    backend = MegatronBackend(hf_dir, TrainConfig(), tensor_model_parallel_size=2)
    try:
        backend.load_megatron_checkpoint(slime_checkpoint(root), "model")
        backend.save_hf(out_dir / "hf")
    finally:
        backend.close()


if __name__ == "__main__":
    main(run)
