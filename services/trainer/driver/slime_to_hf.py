"""Convert a slime (Megatron-LM) torch_dist checkpoint into an HF directory, for train_backend fsdp (which reads HF
weights; `slime_checkpoint_conversion` runs this at job start) or any other HF consumer: the Megatron backend reads the
checkpoint's weights into a model of `--hf-checkpoint`'s architecture (`checkpoint/slime_torch_dist.py`) and exports
them with its HF conversion (`save_hf`).

    python -m services.trainer.driver.slime_to_hf --hf-checkpoint HF_DIR --load ROOT [--ckpt-step N] --out DIR

One process (a world of one); the model must fit its memory.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from services.common.errors import InvalidArgument
from services.trainer.checkpoint.iterations import slime_checkpoint


def convert(hf_checkpoint: str | Path, root: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the HF directory `out` from slime's checkpoint under `root` (its latest, or iteration `step`);
    `hf_checkpoint` gives the architecture, the configs and the tokenizer files."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    path = slime_checkpoint(root, step)
    if path is None:
        raise InvalidArgument(f"{root}: no slime torch_dist checkpoint (latest_checkpointed_iteration.txt and a "
                              "release/ or iter_N/ of dist-checkpointing files)")
    backend = MegatronBackend(hf_checkpoint, TrainConfig())
    try:
        backend.load_megatron_checkpoint(path, "model")
        backend.save_hf(out)
    finally:
        backend.close()
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-checkpoint", required=True, help="HF directory of the model's architecture")
    parser.add_argument("--load", required=True, help="slime's checkpoint root (e.g. /root/Qwen3-8B_torch_dist)")
    parser.add_argument("--ckpt-step", type=int, default=None, help="the iteration to convert (default: latest)")
    parser.add_argument("--out", required=True, help="the HF directory to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(convert(args.hf_checkpoint, args.load, args.out, args.ckpt_step))  # noqa: T201 - the CLI's answer


if __name__ == "__main__":
    main()
