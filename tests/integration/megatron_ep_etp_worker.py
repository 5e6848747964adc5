"""Four gloo ranks of expert parallelism and expert tensor parallelism together: `python -m
tests.integration.megatron_ep_etp_worker OUT MODEL_DIR` (a tiny sigmoid-routed MoE family) at TP=2 × EP=2 × ETP=2
(data-parallel 2 for the dense part; each expert cut over the two TP ranks, two experts on each EP rank): a GRPO
rollout's log-probs before and after its two steps, the steps, and the HF export, in OUT/results.json and OUT/export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from tests.integration.megatron_moe_families_worker import layout_run

WORLD_SIZE = 4
LAYOUT = "tp2_ep2_etp2"  # the layout's (tensor, pipeline, expert, expert tensor) sizes below
SIZES = (2, 1, 2, 2)


def run(rank: int, world_size: int, out_dir: Path, model_dir: Path) -> None:
    import logging
    import warnings

    from tests.integration import megatron_moe_families_worker

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    megatron_moe_families_worker.LAYOUTS[LAYOUT] = SIZES
    result = layout_run(model_dir, LAYOUT, out_dir / "export", None)
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, Path(sys.argv[1]), Path(sys.argv[2]), world_size=WORLD_SIZE,
          start_method="spawn" if torch.cuda.is_available() else "fork")
