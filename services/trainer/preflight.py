"""Submit-time checks of a parsed job spec: what would otherwise fail only after GPUs are allocated. The paths the job
reads exist where the trainer (and the buffer, on the same volume) sees them, the chosen train_backend builds
hf_checkpoint's model family, `megatron:` keys are megatron-core's,
and plugin import paths lie under the operator's allow-list and name a module the images hold (found, not imported:
no plugin code runs before a spec is accepted); every problem is reported at once. (rm_type is checked by the spec
itself, against the reward client's list of scorers.)"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from services.common import plugins
from services.common.errors import InvalidArgument
from services.trainer import model_families
from services.trainer.spec import JobSpec

PLUGIN_FIELDS = ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path",
                 "custom_loss_function_path", "custom_reward_post_process_path", "custom_advantage_function_path",
                 "custom_tis_function_path", "agent_function_path")


def data_path(value: str) -> str:
    """slime's `path@[start:end]` slice notation names the file `path`."""
    return value.split("@[", 1)[0]


def check_paths(spec: JobSpec) -> list[str]:
    problems = []
    if spec.hf_checkpoint.startswith(("/", "./", "../")) and not (Path(spec.hf_checkpoint) / "config.json").is_file():
        problems.append(f"hf_checkpoint: {spec.hf_checkpoint} is no Hugging Face model directory (no config.json) "
                        "on the trainer's volumes")
    # A train-only job replays dumped rollouts: no buffer reads its prompt_data.
    reads = [] if spec.train_only else [("prompt_data", data_path(spec.prompt_data))]
    reads += [("eval_prompt_data", data_path(entry.split("=", 1)[1])) for entry in spec.eval_prompt_data]
    for key, path in reads:
        if not Path(path).is_file():
            problems.append(f"{key}: no file {path} on the trainer's volumes (the buffer reads it from the same path)")
    return problems + _megatron_checkpoints(spec)


def _megatron_checkpoints(spec: JobSpec) -> list[str]:
    """slime's torch_dist checkpoints (ref_load, opd_teacher_load, load) load on train_backend megatron only."""
    from services.trainer.driver.checkpoint import slime_checkpoint

    if spec.train_backend == "megatron":
        return []
    named = (("ref_load", spec.ref_load, spec.ref_ckpt_step),
             ("opd_teacher_load", spec.opd_teacher_load, spec.opd_teacher_ckpt_step),
             ("load", spec.load, spec.ckpt_step))
    return [f"{key}: {path} is a slime (Megatron) torch_dist checkpoint, which train_backend {spec.train_backend} "
            "does not read; use train_backend megatron, or convert it to an HF directory (python -m "
            "services.trainer.backends.megatron.to_hf --hf-checkpoint HF_DIR --load ROOT --out DIR) and name that"
            for key, path, step in named
            if path and slime_checkpoint(path, step) is not None]


def check_plugins(spec: JobSpec) -> list[str]:
    problems = []
    for key in PLUGIN_FIELDS:
        path = getattr(spec, key)
        if "." not in path:  # empty, or a built-in's name (dynamic_sampling_filter_path)
            continue
        try:
            plugins.check_allowed(path, key)
        except InvalidArgument as err:  # before find_spec, which would run the parent packages' __init__
            problems.append(str(err))
            continue
        module = path.rpartition(".")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing or broken
            found = False
        if not found:
            problems.append(f"{key}: module {module!r} of {path!r} is not importable (install it in the images)")
    return problems


def check_model_family(spec: JobSpec) -> list[str]:
    """The chosen backend builds hf_checkpoint's model (read where the trainer sees it; a hub id is not checked)."""
    path = Path(spec.hf_checkpoint) / "config.json"
    if not path.is_file():
        return []
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return [f"hf_checkpoint: cannot read {path} ({err})"]
    problem = model_families.check(spec.train_backend, hf_config, tp_size=spec.tensor_model_parallel_size,
                                   pp_size=spec.pipeline_model_parallel_size,
                                   ep_size=spec.expert_model_parallel_size) if isinstance(hf_config, dict) else ""
    return [problem] if problem else []


def check_megatron(spec: JobSpec) -> list[str]:
    if spec.train_backend != "megatron" or not spec.megatron:
        return []
    from services.trainer.backends.megatron import args  # megatron-core: only for specs that use it

    try:
        args.split(spec.megatron)
    except InvalidArgument as err:
        return [str(err)]
    return []


INT32_MAX = 2**31 - 1


def check_rollout_ranges(spec: JobSpec) -> list[str]:
    """The rollout settings the manager receives as int32 (rollout_max_response_len, ...) fit one: a bigger value
    would be accepted here and fail the job at its first rollout."""
    from google.protobuf.descriptor import FieldDescriptor

    from services.common.gen.physarum.v1 import rollout_pb2

    rollout = spec.rollout
    problems = []
    for field in rollout_pb2.RolloutConfig.DESCRIPTOR.fields:
        value = getattr(rollout, field.name, None)
        if field.type == FieldDescriptor.TYPE_INT32 and isinstance(value, int) and not -INT32_MAX - 1 <= value \
                <= INT32_MAX:
            problems.append(f"{field.name}: {value} is out of range (at most {INT32_MAX})")
    return problems


CHECKS: tuple[Callable[[JobSpec], list[str]], ...] = (check_paths, check_model_family, check_megatron,
                                                      check_plugins, check_rollout_ranges)


def preflight(spec: JobSpec) -> JobSpec:
    """The spec, or InvalidArgument listing every problem found."""
    problems = [problem for check in CHECKS for problem in check(spec)]
    if problems:
        raise InvalidArgument("job spec: " + "; ".join(problems))
    return spec


def with_preflight(parse: Callable[[object], JobSpec]) -> Callable[[object], JobSpec]:
    """A spec parser that also runs the submit-time checks."""
    return lambda data: preflight(parse(data))
