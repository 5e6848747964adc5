"""Submit-time checks of a parsed job spec: what would otherwise fail only after GPUs are allocated. The paths the job
reads exist where the trainer (and the buffer, on the same volume) sees them, the chosen train_backend builds
hf_checkpoint's model family, `megatron:` keys are megatron-core's and its OptimizerConfig takes them,
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
from services.trainer.api.context_fit import check_context
from services.trainer.api.spec import JobSpec
from services.trainer.backends import capabilities
from services.trainer.models import families, mtp

PLUGIN_FIELDS = ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path",
                 "custom_loss_function_path", "custom_reward_post_process_path", "custom_advantage_function_path",
                 "custom_tis_function_path", "agent_function_path", "rollout_function_path", "data_source_path",
                 "buffer_filter_path", "eval_function_path")
# the hooks whose definition is read (not imported) at submit: a missing name or a wrong signature fails here
SIGNATURES = {"rollout_function_path": plugins.ROLLOUT_FUNCTION, "data_source_path": plugins.DATA_SOURCE,
              "buffer_filter_path": plugins.BUFFER_FILTER, "eval_function_path": plugins.ROLLOUT_FUNCTION}

QUANTIZED_REFUSAL = ("quantized checkpoints are not supported (the backends train bf16 or float32 weights and send "
                     "them to the engines as they are); use the model's unquantized checkpoint")


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
    """The checkpoints the job loads (load, ref_load, opd_teacher_load) are there; slime's torch_dist ones load on
    train_backend megatron as they are, and on a backend of HF weights through a conversion at job start by the
    megatron backend, which must build hf_checkpoint's model."""
    from services.trainer.checkpoint.iterations import checkpoint_problem, slime_checkpoint

    named = (("ref_load", spec.ref_load, spec.ref_ckpt_step),
             ("opd_teacher_load", spec.opd_teacher_load, spec.opd_teacher_ckpt_step),
             ("load", spec.load, spec.ckpt_step))
    problems = [f"{key}: {why}" for key, path, step in named if path and (why := checkpoint_problem(path, step))]
    if capabilities.capabilities(spec.train_backend).slime_checkpoints:
        return problems
    slime = [key for key, path, step in named if path and slime_checkpoint(path, step) is not None]
    if slime and (why := _conversion_problem(spec)):
        problems += [f"{key}: {getattr(spec, key)} is a slime (Megatron) torch_dist checkpoint, which train_backend "
                     f"{spec.train_backend} reads through a conversion to HF by the megatron backend, and that cannot "
                     f"build hf_checkpoint's model ({why}); use an HF directory" for key in slime]
    return problems


def _conversion_problem(spec: JobSpec) -> str:
    path = Path(spec.hf_checkpoint) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return f"cannot read {path}: {err}"
    return capabilities.capabilities("megatron").model_problem(hf_config) if isinstance(hf_config, dict) else \
        f"{path} is not a JSON object"


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
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a parent package that is missing or broken
            found = None
        if found is None:
            problems.append(f"{key}: module {module!r} of {path!r} is not importable (install it in the images)")
        elif key in SIGNATURES and (problem := plugins.signature_problem(found.origin, path, key, SIGNATURES[key])):
            problems.append(problem)
    return problems


def check_model_family(spec: JobSpec) -> list[str]:
    """The chosen backend builds hf_checkpoint's model (read where the trainer sees it; a hub id is not checked), which
    is not quantized, and context parallelism can split it."""
    path = Path(spec.hf_checkpoint) / "config.json"
    if not path.is_file():
        return []
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return [f"hf_checkpoint: cannot read {path} ({err})"]
    if not isinstance(hf_config, dict):
        return []
    if isinstance(quantized := hf_config.get("quantization_config"), dict):
        # e.g. slime's FP8 rollout: an FP8 checkpoint the engines serve, bf16 weights quantized at each sync
        return [f"hf_checkpoint: {path} has a quantization_config (quant_method "
                f"{quantized.get('quant_method', '?')!r}): {QUANTIZED_REFUSAL}"]
    # uneven pipeline stages (the `megatron:` section's; a backend without that section takes no such setting)
    ends = {"first": spec.megatron.get("num_layers_in_first_pipeline_stage"),
            "last": spec.megatron.get("num_layers_in_last_pipeline_stage")}
    problems = [capabilities.model_problem(spec.train_backend, hf_config, tp_size=spec.tensor_model_parallel_size,
                                           pp_size=spec.pipeline_model_parallel_size,
                                           ep_size=spec.expert_model_parallel_size, pipeline_ends=ends,
                                           etp_size=spec.expert_tensor_parallel_size)]
    problems.append(mtp.problem(hf_config, spec.mtp_num_layers))
    if spec.multimodal_keys and not families.is_vision_language(hf_config, images=True):
        problems.append(f"multimodal_keys: hf_checkpoint's model_type {hf_config.get('model_type')!r} has no vision "
                        "tower (no vision_config, or no image-text-to-text model in transformers); use a "
                        "vision-language checkpoint (qwen2_5_vl, qwen3_vl, qwen3_5, ...)")
    split = capabilities.capabilities(spec.train_backend).context_parallel_problem
    if spec.context_parallel_size > 1 and (why := split(hf_config, images=bool(spec.multimodal_keys))):
        problems.append(f"context_parallel_size {spec.context_parallel_size}: hf_checkpoint's model cannot be split "
                        f"over ranks ({why}); use context_parallel_size 1")
    if spec.context_parallel_size > 1 and (spec.use_routing_replay or spec.use_rollout_routing_replay
                                          or spec.moe_aux_loss_coeff > 0):
        problems.append(f"context_parallel_size {spec.context_parallel_size}: routing replay and moe_aux_loss_coeff "
                        "need each token's router logits on one rank; use context_parallel_size 1")
    layout = {"tp_size": spec.tensor_model_parallel_size,
              "sequence_parallel": bool(spec.megatron.get("sequence_parallel"))}
    if spec.use_routing_replay or spec.use_rollout_routing_replay:
        problems.append(capabilities.router_problem("routing replay", spec.train_backend, hf_config, **layout))
    if spec.moe_aux_loss_coeff > 0 and spec.moe_router_load_balancing_type != "none":
        problems.append(capabilities.router_problem("moe_aux_loss_coeff", spec.train_backend, hf_config, **layout))
    if spec.moe_aux_loss_coeff > 0:
        problems.append(capabilities.load_balancing_problem(spec.train_backend, spec.moe_router_load_balancing_type))
    if any(spec.megatron.get(name) for name in ("hidden_dropout", "attention_dropout")) and \
            (why := families.megatron_train_mode_problem(hf_config, **layout)):
        problems.append(f"megatron dropout: train_backend megatron {why.removeprefix('it ')}")
    return [problem for problem in problems if problem]


def check_megatron(spec: JobSpec) -> list[str]:
    if not spec.megatron:  # only a backend with capabilities.extra_flags takes them (LayoutConfig checks)
        return []
    from services.trainer.backends.megatron import args  # megatron-core: only for specs that use it

    try:
        split = args.split(spec.megatron)
        args.check_optimizer(split.optimizer, use_distributed_optimizer=spec.layout.use_distributed_optimizer)
    except InvalidArgument as err:
        return [str(err)]
    if spec.megatron.get("sequence_parallel") and spec.tensor_model_parallel_size == 1:
        return ["megatron.sequence_parallel: needs tensor_model_parallel_size > 1 (it splits each row's tokens over "
                "the tensor-parallel ranks); drop it or set tensor_model_parallel_size"]
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


def check_ranks(spec: JobSpec, world_size: int) -> list[str]:
    """The layout fits the trainer's `world_size` ranks: context-parallel groups, and whole groups of samples for
    each data-parallel share of a step."""
    cp = spec.context_parallel_size
    if world_size % cp:
        return [f"context_parallel_size {cp} must divide the trainer's {world_size} ranks"]
    dp = world_size // cp
    step, n = spec.resolved_global_batch_size, spec.n_samples_per_prompt
    if capabilities.capabilities(spec.train_backend).reads_shares and dp > 1 and step % (dp * n):
        return [f"global_batch_size ({step}) must be a multiple of the data-parallel ranks × n_samples_per_prompt "
                f"({world_size} ranks / context_parallel_size {cp} = {dp} × {n})"]
    return []


CHECKS: tuple[Callable[[JobSpec], list[str]], ...] = (check_paths, check_model_family, check_megatron,
                                                      check_plugins, check_rollout_ranges, check_context)


def preflight(spec: JobSpec, world_size: int | None = None) -> JobSpec:
    """The spec, or InvalidArgument listing every problem found; with the trainer's world_size, its layout too."""
    problems = [problem for check in CHECKS for problem in check(spec)]
    if world_size is not None:
        problems += check_ranks(spec, world_size)
    if problems:
        raise InvalidArgument("job spec: " + "; ".join(problems))
    return spec


def with_preflight(parse: Callable[[object], JobSpec],
                   world_size: int | None = None) -> Callable[[object], JobSpec]:
    """A spec parser that also runs the submit-time checks (the layout's against world_size ranks, when given)."""
    return lambda data: preflight(parse(data), world_size)
