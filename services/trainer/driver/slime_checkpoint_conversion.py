"""slime's torch_dist checkpoints for a backend that reads HF weights only (train_backend fsdp): at job start rank 0
converts each one the job names (ref_load, opd_teacher_load, load) into an HF directory with `slime_to_hf`, in a
process of its own (a world of one, on the CPU: the trainer's GPUs stay its own), while the other ranks wait; then
every rank loads that directory as it loads any HF model. A job with `save` keeps the copies under it, so a restarted
job converts nothing twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from services.common.errors import DeadlineExceeded, InvalidArgument
from services.trainer.checkpoint.iterations import slime_checkpoint
from services.trainer.distributed.parallel import World
from services.trainer.settings.driver import DriverConfig

log = logging.getLogger(__name__)

# the checkpoints a job names, with the key of the iteration each picks
NAMED = (("ref_load", "ref_ckpt_step"), ("opd_teacher_load", "opd_teacher_ckpt_step"), ("load", "ckpt_step"))
# the other ranks wait in a collective meanwhile: under the trainer's collective timeout (30 min)
CONVERT_TIMEOUT_S = 1500.0
# the launcher's variables: the converter must start a world of its own, not join the trainer's
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")
HF_DIR = "slime_hf"  # under the job's save root


def output_root(driver: DriverConfig) -> Path:
    """Where the HF copies go: under the job's checkpoint root when it has one (every rank sees it, and a restarted
    job finds them), else the host's temporary directory (one host)."""
    return Path(driver.save) / HF_DIR if driver.save else Path(tempfile.gettempdir()) / "physarum-slime-hf"


def converted_paths(driver: DriverConfig, world: World) -> DriverConfig:
    """`driver` with each slime torch_dist checkpoint it names replaced by an HF copy (its step then picked);
    collective: rank 0 converts, the others wait for it."""
    named = {key: (getattr(driver, key), getattr(driver, step_key)) for key, step_key in NAMED
             if getattr(driver, key) and slime_checkpoint(getattr(driver, key), getattr(driver, step_key)) is not None}
    if not named:
        return driver
    copies = world.on_rank0(_convert_all, driver, named)
    steps = {step_key: None for key, step_key in NAMED if key in named}
    return dataclasses.replace(driver, **copies, **steps)


def _convert_all(driver: DriverConfig, named: dict[str, tuple[str, int | None]]) -> dict[str, str]:
    return {key: str(convert_once(driver.hf_checkpoint, root, step, output_root(driver)))
            for key, (root, step) in named.items()}


def convert_once(hf_checkpoint: str, root: str, step: int | None, out_root: Path) -> Path:
    """The HF copy of slime's checkpoint (root, step): made now, or found from an earlier conversion."""
    source = slime_checkpoint(root, step)
    assert source is not None, root
    # the source's path and when it was written: a checkpoint written again over the same path is converted again
    written_ns = (source / "metadata.json").stat().st_mtime_ns
    digest = hashlib.sha256(f"{source.resolve()}@{written_ns}".encode()).hexdigest()[:12]
    out = out_root / f"{Path(root).resolve().name}-{source.name}-{digest}"
    if (out / "config.json").is_file():
        log.info("slime's checkpoint %s: HF copy %s (converted before)", source, out)
        return out
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "services.trainer.driver.slime_to_hf", "--hf-checkpoint", hf_checkpoint,
               "--load", str(root), "--out", str(partial)] + (["--ckpt-step", str(step)] if step is not None else [])
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""
    log.info("slime's checkpoint %s: converting to HF in %s", source, out)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        shutil.rmtree(partial, ignore_errors=True)
        raise DeadlineExceeded(f"slime's checkpoint {source}: its conversion to HF took over "
                               f"{CONVERT_TIMEOUT_S:.0f} s; convert it beforehand ({' '.join(command[1:])}) and name "
                               "the HF directory") from None
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise InvalidArgument(f"slime's checkpoint {source}: the conversion to HF failed (exit {done.returncode}): "
                              f"{done.stderr.strip()[-2000:]}")
    if (out / "config.json").is_file():  # another trainer on this host converted it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    else:
        shutil.rmtree(out, ignore_errors=True)  # what a conversion cut short left
        os.replace(partial, out)
    return out
