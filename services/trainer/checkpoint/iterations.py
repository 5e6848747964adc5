"""Checkpoints and debug rollout dumps on disk, in slime's layout.

`{save}/iter_{rollout_id:07d}/` holds each rank's RNG states, trainer_state.json (the rollout id and the buffer's
data-source state) and the backend's state, written and read through `BackendState`: Megatron-LM's torch_dist files in
iter_N/ itself (train_backend megatron: slime's and Megatron-LM's `--load` resume from them too), or dcp/
(torch.distributed.checkpoint); beside a torch_dist one, slime's data-source state in
`rollout/global_dataset_state_dict_N.pt`. `latest_checkpointed_iteration.txt` names the newest complete one: it is
rewritten last, so a save cut short leaves the previous checkpoint in force.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.common import write_roots
from services.common.errors import InvalidArgument
from services.common.samples import Sample, Status
from services.trainer.distributed.parallel import World

if TYPE_CHECKING:
    from services.trainer.checkpoint.backend_state import BackendState

log = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"


SLIME_DATA_STATE = "rollout/global_dataset_state_dict_{rollout_id}.pt"  # slime's data source reads it on --load
TORCH_DIST = "torch_dist"  # Megatron-LM's format, whose files lie in iter_N/ itself (where slime looks for them)
TORCH_DIST_FILE = "metadata.json"  # what dist-checkpointing writes into every checkpoint directory


def state_dir(path: Path, fmt: str) -> Path:
    """Where a backend of format `fmt` keeps its state in the checkpoint directory `path`."""
    return path if fmt == TORCH_DIST else path / fmt


def _state_dir(path: Path, backend: BackendState) -> Path:
    """The backend's state in iter_N/; a checkpoint written by a backend of another format is refused."""
    fmt = backend.checkpoint_format
    if fmt == TORCH_DIST and (path / TORCH_DIST_FILE).is_file() or fmt != TORCH_DIST and (path / fmt).is_dir():
        return state_dir(path, fmt)
    found = [f"{p.name}/" for p in sorted(path.iterdir()) if p.is_dir()] if path.is_dir() else []
    found += [f"{TORCH_DIST} files"] if (path / TORCH_DIST_FILE).is_file() else []
    if found:
        wanted = f"{TORCH_DIST} files in iter_N/ itself" if fmt == TORCH_DIST else f"{fmt}/"
        raise InvalidArgument(f"checkpoint {path}: holds {', '.join(found)}, written by another train_backend (or an "
                              f"earlier Physarum); this job's backend reads {wanted}")
    return state_dir(path, fmt)


@dataclass
class TrainerState:
    """What the driver needs to resume: the last rollout trained on and the buffer's data-source state."""

    rollout_id: int
    job_id: str
    world_size: int
    buffer: dict[str, Any] | None = None  # services.buffer.client.DataSourceState.to_dict(); None: no buffer


METRICS_FILE = "rollout_metrics.json"


def saved_metrics(root: str | Path, rollout_id: int) -> dict[str, float] | None:
    """The metrics of rollout `rollout_id` saved with its checkpoint (None: none were)."""
    try:
        metrics = json.loads((iteration_dir(root, rollout_id) / METRICS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) else None


def iteration_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"iter_{rollout_id:07d}"


def slime_checkpoint(root: str | Path, step: int | None = None) -> Path | None:
    """The directory of a slime (Megatron-LM) torch_dist checkpoint under root, or None when root is not one:
    latest_checkpointed_iteration.txt holds `release` or an iteration (`step` picks another, slime's
    --ckpt-step), and release/ or iter_{N:07d}/ holds dist-checkpointing's files itself (Physarum's own
    iter_N/ holds trainer_state.json and the backend's directory)."""
    latest = Path(root) / LATEST_FILE
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    name = iteration_dir(root, step).name if step is not None else \
        "release" if text == "release" else iteration_dir(root, int(text)).name if text.isdigit() else ""
    path = Path(root) / name
    if name and (path / "metadata.json").is_file() and not (path / STATE_FILE).is_file():
        return path
    return None


def checkpoint_problem(root: str | Path, step: int | None = None) -> str:
    """Why the checkpoint root names a checkpoint that is not there ("" when it is, or when root holds none, e.g.
    an HF directory): the directory its latest file (or `step`) names, and a slime one's torch_dist files."""
    latest = Path(root) / LATEST_FILE
    if not latest.is_file():
        return ""
    text = latest.read_text().strip()
    if step is not None:
        name = iteration_dir(root, step).name
    elif text == "release" or text.isdigit():
        name = "release" if text == "release" else iteration_dir(root, int(text)).name
    else:
        return f"{latest} holds {text!r}, not `release` or an iteration"
    path = Path(root) / name
    if not path.is_dir():
        return f"{root} has no {name}/ (named by {'the ckpt step' if step is not None else LATEST_FILE})"
    if not (path / STATE_FILE).is_file() and not ((path / TORCH_DIST_FILE).is_file()
                                                  and (path / ".metadata").is_file()):
        return f"{path} holds neither Physarum's checkpoint ({STATE_FILE}) nor a torch_dist one ({TORCH_DIST_FILE} " \
               "and .metadata)"
    return ""


def latest_iteration(root: str | Path) -> int | None:
    """The rollout id in root's latest_checkpointed_iteration.txt; None when root holds no checkpoint."""
    path = Path(root) / LATEST_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise InvalidArgument(f"checkpoint {path}: expected a rollout id, got {text!r}")
    return int(text)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, rollout_id: int, backend: BackendState, world: World,
                    trainer_state: Callable[[], TrainerState], metrics: dict[str, float] | None = None) -> Path:
    """Every rank: write checkpoint `rollout_id` under root. `trainer_state` runs on rank 0 only, first (it takes
    the buffer's snapshot); a failure there ends the save on every rank before anything is written. `metrics`, the
    rollout's, are kept with it (saved_metrics)."""
    root = write_roots.writable_dir(root, write_roots.CHECKPOINTS, "save")  # checked now, not only at submit
    path = iteration_dir(root, rollout_id)
    # taken first, written after the backend's files (dist-checkpointing wants an empty directory)
    state = world.on_rank0(lambda: dataclasses.asdict(trainer_state()))
    backend.save_sharded(state_dir(path, backend.checkpoint_format), rollout_id=rollout_id)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / f"rng_rank{world.rank}.pt")
    world.barrier()
    if world.rank == 0:
        _write_atomic(path / STATE_FILE, json.dumps(state, indent=1))
        if metrics:  # the rollout's metrics go with the checkpoint: a kill before they are reported loses none
            _write_atomic(path / METRICS_FILE, json.dumps(metrics))
        if backend.checkpoint_format == TORCH_DIST and state["buffer"] is not None:  # slime's --load reads this one
            data_state = Path(root) / SLIME_DATA_STATE.format(rollout_id=rollout_id)
            data_state.parent.mkdir(parents=True, exist_ok=True)
            torch.save(slime_data_state(state["buffer"]), data_state)
        _write_atomic(Path(root) / LATEST_FILE, f"{rollout_id}\n")
        log.info("saved checkpoint %s", path)
    return path


def slime_data_state(buffer: dict[str, Any]) -> dict[str, int | dict]:
    """slime's RolloutDataSource state for the buffer's (`DataSourceState.to_dict()`): the epoch, and as its offset
    the prompts of that epoch trained on (handed out, less those returned, leased or pending: slime serves in order,
    so it hands those out again rather than skip them; under rollout_shuffle its own order is another)."""
    epoch = buffer["epoch"]
    slots = [slot for key in ("returned", "leased", "pending") for slot in buffer[key]]
    unserved = sum(slot.split(":")[0] == str(epoch) for slot in slots)
    offset = max(0, buffer["cursor"] - unserved)
    return {"sample_offset": offset, "epoch_id": epoch, "sample_group_index": epoch * buffer["num_prompts"] + offset,
            "metadata": {}}


def load_checkpoint(root: str | Path, backend: BackendState, world: World,
                    rollout_id: int | None = None) -> TrainerState | None:
    """Every rank: restore checkpoint `rollout_id` (default: the latest) into the backend and this rank's RNG.

    Returns its TrainerState, or None when root holds no checkpoint. Parts of the backend's state that the
    checkpoint lacks (e.g. a reference model it was saved without) keep their current values.
    """
    rollout_id = latest_iteration(root) if rollout_id is None else rollout_id
    if rollout_id is None:
        return None
    path = iteration_dir(root, rollout_id)
    if not (path / STATE_FILE).is_file():
        raise InvalidArgument(f"checkpoint {path}: no {STATE_FILE} (not a complete checkpoint)")
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    load_state(_state_dir(path, backend), backend, world)
    rng_path = path / f"rng_rank{world.rank}.pt"
    if rng_path.is_file():
        # a checkpoint runs no pickle; host tensors whatever machine wrote them (CUDA RNG states are CPU tensors)
        set_rng_state(torch.load(rng_path, weights_only=True, map_location="cpu"))
    else:
        log.warning("checkpoint %s has no RNG state for rank %d (saved by %d ranks); keeping this rank's", path,
                    world.rank, state.world_size)
    log.info("loaded checkpoint %s (rollout %d of job %s)", path, state.rollout_id, state.job_id)
    return state


def load_state(path: Path, backend: BackendState, world: World, parts: tuple[str, ...] | None = None) -> None:
    """Load the top-level parts (model, optim, ref_model, ...) of a checkpoint's state directory (the backend's
    format) that the backend has, or only `parts`; the backend's parts the checkpoint lacks keep their values."""
    if not path.is_dir():
        raise InvalidArgument(f"checkpoint {path}: no such directory")
    loaded = backend.load_sharded(path, None if parts is None else set(parts))
    if missing := set(parts if parts is not None else backend.checkpoint_parts()) - loaded:
        log.warning("checkpoint %s has no %s; keeping the current ones", path, ", ".join(sorted(missing)))


# a frozen model the trainer loads -> (its name in the log, the backend's HF load, its sharded load)
FROZEN_MODELS = {"ref_model": ("reference model", "load_ref", "load_ref_sharded"),
                 "teacher": ("distillation teacher", "load_teacher", "load_teacher_sharded")}


def load_frozen(into: str, root: str | Path, backend: BackendState, rollout_id: int | None = None) -> None:
    """A frozen model (`into`: ref_model, teacher) from an HF directory, a slime torch_dist checkpoint, or the policy
    of a checkpoint root's checkpoint `rollout_id` (default: the latest), Physarum's or slime's."""
    what, load_hf, load_sharded = FROZEN_MODELS[into]
    if (slime := slime_checkpoint(root, rollout_id)) is not None:
        backend.load_megatron_checkpoint(slime, into)
        log.info("%s from slime's checkpoint %s", what, slime)
        return
    rollout_id = latest_iteration(root) if rollout_id is None else rollout_id
    if rollout_id is None:
        getattr(backend, load_hf)(root)
        return
    path = _state_dir(iteration_dir(root, rollout_id), backend)
    getattr(backend, load_sharded)(path)
    log.info("%s from checkpoint %s", what, path)


def load_reference(root: str | Path, backend: BackendState, world: World, rollout_id: int | None = None) -> None:
    """slime's --ref-load (and --ref-ckpt-step)."""
    load_frozen("ref_model", root, backend, rollout_id)


def load_teacher(root: str | Path, backend: BackendState, world: World, rollout_id: int | None = None) -> None:
    """slime's --opd-teacher-load (and --opd-teacher-ckpt-step)."""
    load_frozen("teacher", root, backend, rollout_id)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----- slime's debug rollout dumps: {"rollout_id": i, "samples": [sample dicts]} written with torch.save -----

def debug_rollout_path(pattern: str, rollout_id: int) -> Path:
    return Path(pattern.format(rollout_id=rollout_id))


def save_debug_rollout_data(pattern: str, rollout_id: int, samples: list[Sample]) -> Path:
    path = debug_rollout_path(pattern, rollout_id)
    dumped = [{**dataclasses.asdict(s), "status": s.status.name} for s in samples]
    with write_roots.open_for_write(path, write_roots.EXPORTS, "save_debug_rollout_data") as out:
        torch.save({"rollout_id": rollout_id, "samples": dumped}, out)
    return path


def load_debug_rollout_data(pattern: str, rollout_id: int) -> list[Sample]:
    path = debug_rollout_path(pattern, rollout_id)
    if not path.is_file():
        raise InvalidArgument(f"load_debug_rollout_data: no dump of rollout {rollout_id} at {path}")
    data = torch.load(path, weights_only=True)
    try:
        return [Sample(**{**s, "status": Status[s["status"]]}) for s in data["samples"]]
    except (KeyError, TypeError) as err:
        raise InvalidArgument(f"load_debug_rollout_data {path}: not a rollout dump ({err})") from None
