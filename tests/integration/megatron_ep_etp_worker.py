"""Four gloo ranks of expert parallelism and expert tensor parallelism together: `python -m
tests.integration.megatron_ep_etp_worker OUT MODEL_DIR` (a tiny sigmoid-routed MoE family) at TP=2 × EP=2 × ETP=2
(data-parallel 2 for the dense part; each expert cut over the two TP ranks, two experts on each EP rank): a GRPO
rollout's log-probs before and after its two steps, the steps, and the HF export, in OUT/results.json and OUT/export."""

from __future__ import annotations

from pathlib import Path

from tests.integration.family_parity import layout_run, main, run_models
from tests.integration.megatron_moe_families_worker import backend_layout

WORLD_SIZE = 4
SIZES = (2, 1, 2, 2)  # (tensor, pipeline, expert, expert tensor) parallel sizes


def run(rank: int, world_size: int, out_dir: Path, model_dirs: list[Path]) -> None:
    run_models(rank, out_dir, model_dirs, lambda model_dir: layout_run(model_dir, backend_layout(SIZES),
                                                                       save_dir=out_dir / "export"))


if __name__ == "__main__":
    main(run, world_size=WORLD_SIZE)
