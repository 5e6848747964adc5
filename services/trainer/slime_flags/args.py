"""slime's argv as a job spec: `slime_args: "--hf-checkpoint /m --rollout-batch-size 32 ..."` in a submitted spec
(CLI `--slime-args`, REST and gRPC alike) becomes spec keys, by the flag tables of flags.py and
megatron_flags.py. Keys the spec sets itself win over converted ones.

Every flag is implemented (the spec key of its name), mapped (to spec keys, to the `megatron:` section, or kept in
`plugin_args` for plugins), refused (the reason), or unknown (an error). As slime does, train_backend defaults to
megatron when the arguments do not say. The argv reads by argparse's rules: a flag given twice takes its last value
(an `append` flag collects them), values take slime's declared type, choices and count; `slime_sources` records
where each value came from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.common.errors import InvalidArgument
from services.trainer.backends.capabilities import capabilities
from services.trainer.slime_flags.argv import destination, last_wins, slime_value, split_argv_at
from services.trainer.slime_flags.eval_config import eval_spec
from services.trainer.slime_flags.flags import (
    FLAGS,
    JSON_FLAGS,
    MOE_REFUSAL,
    STORE_FALSE,
    Flag,
    is_moe_flag,
    spec_key,
)
from services.trainer.slime_flags.lora_flags import LORA_FLAGS, lora_value
from services.trainer.slime_flags.megatron_flags import ARCH, MEGATRON, MEGATRON_FIELD, NEGATED, check_arch

ENGINE_PREFIXES = ("sglang-", "router-")  # slime's prefixed SGLang server and router arguments
_LAYOUT_ONE: tuple[str, ...] = ()
_SPEC_KEYS = {"tensor-model-parallel-size", "pipeline-model-parallel-size", "expert-model-parallel-size",
              "expert-tensor-parallel-size",
              "context-parallel-size",
              "use-distributed-optimizer", "ckpt-step",
              "lr-decay-style", "lr-decay-iters", "lr-warmup-iters", "min-lr", "weight-decay", "adam-beta1",
              "adam-beta2", "adam-eps", "bf16", "moe-aux-loss-coeff", "moe-router-load-balancing-type"}


@dataclass
class Conversion:
    spec: dict[str, Any] = field(default_factory=dict)
    plugin_args: dict[str, Any] = field(default_factory=dict)  # values of flags with no spec key of their own
    megatron: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # mapped flags the deployment handles: said, not hidden
    refused: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    no_advantages: bool = False  # --disable-compute-advantages-and-returns: only with sft_loss
    opd_reward: bool = False  # slime's on_policy_distillation reward function: the teacher at --rm-url
    opd_post_process: bool = False  # its reward post-process
    eval_config: str = ""  # --eval-config's path
    custom_config: str = ""  # --custom-config-path's path
    num_epoch: int = 0  # --num-epoch
    invalid: list[str] = field(default_factory=list)  # values slime's parser would reject (type, choice, count)
    sources: dict[str, str] = field(default_factory=dict)  # each flag's key -> where its value came from
    spec_keys: set[str] = field(default_factory=set)  # the job spec's keys


def slime_defaults() -> dict[str, Any]:
    """What slime's `args` holds for every flag not given, by spec key (plugins read these)."""
    flags = {**MEGATRON, **FLAGS}
    return {spec_key(name): (False if name in STORE_FALSE else json.loads(flag.default) if name in JSON_FLAGS
                             else flag.default) for name, flag in flags.items()}


def scalar(text: str) -> Any:
    """A flag's value as YAML reads it ("8" -> 8, "1e-6" -> 1e-06, "true" -> True), else the string."""
    if text.lower() in ("none", "null", "~"):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and text.strip().lstrip("+-").replace(".", "", 1).replace("e-", "", 1).isdigit():
        return float(text)
    return value if isinstance(value, (int, float, bool, str)) else text


def _value(name: str, flag: Flag | None, values: list[str]) -> Any:
    """A Megatron or engine flag's value: True when bare, else as YAML reads it."""
    if flag is not None and flag.bare:
        if values:
            raise InvalidArgument(f"slime_args: --{name} takes no value, got {' '.join(values)}")
        return True
    if not values:
        return True  # a bare flag of an engine option
    if flag is not None and flag.nargs:
        return [scalar(v) for v in values]
    return scalar(values[0]) if len(values) == 1 else [scalar(v) for v in values]


def read_hf_config(hf_checkpoint: Any) -> dict[str, Any] | None:
    path = Path(str(hf_checkpoint or "")) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def convert(argv: str | list[str], *, spec_keys: set[str], hf_config: dict[str, Any] | None = None,
            check_architecture: bool = True) -> Conversion:
    """Sort each flag; `spec_keys` are the job spec's keys (an implemented flag's key must be one).

    The architecture flags are checked against `hf_config` (by default hf_checkpoint's config.json) unless
    check_architecture is false."""
    pairs, sources = last_wins(split_argv_at(argv))
    given = dict(pairs)
    out = Conversion(sources=sources, spec_keys=spec_keys)
    if hf_config is None and check_architecture:
        hf_config = read_hf_config(given["hf-checkpoint"][-1] if given.get("hf-checkpoint") else None)
    for name, values in pairs:
        dest = destination(name)
        try:
            _convert_one(out, dest, [] if dest != name else values, spec_keys, hf_config, check_architecture)
        except InvalidArgument as err:
            out.invalid.append(str(err))
            continue
        if dest != name:
            out.plugin_args[spec_key(dest)] = False
    out.spec.setdefault("train_backend", "megatron")
    if out.custom_config:
        _apply_custom_config(out, out.custom_config)
    if out.num_epoch:
        _resolve_num_epoch(out)
    if out.eval_config:
        eval_keys, problems = eval_spec(out.eval_config, out.spec)
        out.spec.update(eval_keys)
        out.refused += problems
    if out.opd_reward or out.opd_post_process:
        _resolve_opd_reward(out)
    if out.spec.get("loss_type") == "sft_loss" and out.spec.get("debug_train_only") and \
            not out.spec.get("load_debug_rollout_data"):  # slime's SFT scripts: sft_rollout without engines
        del out.spec["debug_train_only"]
        out.notes.append("--debug-train-only: dropped; with sft_loss (slime's sft_rollout) the rollout service "
                         "builds each sample from its prompt and label, generating nothing, as slime's SFT does")
    if out.spec.get("ref_load") and not (out.spec.get("use_kl_loss") or out.spec.get("kl_coef")):
        del out.spec["ref_load"]  # slime reads it then only as the starting weights, when --load holds no checkpoint
        out.notes.append("--ref-load: dropped, no reference model (no KL); slime starts from it when --load holds no "
                         "checkpoint, Physarum from hf_checkpoint's weights (the same model in slime's scripts)")
    if out.no_advantages and out.spec.get("loss_type") != "sft_loss":
        out.refused.append("--disable-compute-advantages-and-returns: " +
                           FLAGS["disable-compute-advantages-and-returns"].note)
    _resolve_load_balancing_type(out)
    tp = int(out.spec.get("tensor_model_parallel_size", 1) or 1)
    if out.megatron.get("sequence_parallel") and tp == 1:
        del out.megatron["sequence_parallel"]
        out.notes.append("--sequence-parallel: dropped without tensor parallelism, as Megatron does")
    return out


def _resolve_load_balancing_type(out: Conversion) -> None:
    """Megatron's seq_aux_loss and global_aux_loss (GLM's and DeepSeek's scripts): under --moe-aux-loss-coeff 0 no
    load-balancing loss is added whatever its type, so the job runs as with none; with a weight the spec keeps the
    type (global_aux_loss is train_backend megatron's alone: the job's checks refuse it on fsdp)."""
    kind = out.spec.get("moe_router_load_balancing_type")
    if kind not in ("seq_aux_loss", "global_aux_loss"):
        return
    if float(out.spec.get("moe_aux_loss_coeff", 0.0) or 0.0) == 0.0:
        out.spec["moe_router_load_balancing_type"] = "none"
        out.notes.append(f"--moe-router-load-balancing-type {kind}: no load-balancing loss under --moe-aux-loss-coeff "
                         "0, as in Megatron; the job runs with none")


def _convert_one(out: Conversion, name: str, values: list[str], spec_keys: set[str],
                 hf_config: dict[str, Any] | None, check_architecture: bool) -> None:
    key = spec_key(name)
    if name in LORA_FLAGS:
        out.spec[key] = lora_value(name, values)
        return
    if name in FLAGS:
        flag = FLAGS[name]
        value = slime_value(name, values)
        if name in _SPECIAL:
            _SPECIAL[name](out, value)
        elif flag.status == "refused":
            out.refused.append(f"--{name}: {flag.note}")
        elif flag.status == "implemented":
            if key not in spec_keys:
                raise InvalidArgument(f"slime_args: --{name} is marked implemented but the job spec has no {key!r}")
            out.spec[key] = value
        else:
            out.plugin_args[key] = value
            if flag.warn:
                out.notes.append(f"--{name}: {flag.note}")
        return
    if name in ARCH:
        value = _value(name, None if values else Flag("mapped", None, bare=True), values)
        out.plugin_args[key] = value
        problem = check_arch(name, value, hf_config) if check_architecture else ""
        if problem:
            out.refused.append(problem)
        return
    if name in MEGATRON:
        _convert_megatron(out, name, _value(name, MEGATRON[name], values))
        return
    if name.startswith(ENGINE_PREFIXES):
        out.plugin_args[key] = _value(name, None, values)
        if name.startswith("sglang-"):
            out.notes.append(f"--{name}: an SGLang server option: the rollout service relaunches the engines it "
                             f"launches with it, and fails the job if engines it did not launch run with another")
        else:
            out.notes.append(f"--{name}: a router option of the rollout service (its Helm values); kept in args for "
                             f"plugins")
        return
    if is_moe_flag(name):
        out.refused.append(f"--{name}: {MOE_REFUSAL}")
        return
    out.unknown.append(f"--{name}")


def _rollout_function(out: Conversion, value: Any) -> None:
    """slime's own rollout functions become what they do here; any other is the job's rollout_function_path."""
    if value in SLIME_ROLLOUTS:
        key, setting = SLIME_ROLLOUTS[value]
        out.spec.setdefault(key, setting)
        out.sources[key] = f"{setting}, from {out.sources['rollout_function_path']}"
    elif value != FLAGS["rollout-function-path"].default:
        out.spec["rollout_function_path"] = value


def _dynamic_filter(out: Conversion, value: Any) -> None:
    """slime's own filters (filter_hub.dynamic_sampling_filters) are the rollout service's built-ins of the same name;
    any other path is a plugin."""
    module, _, name = str(value).rpartition(".")
    builtin = module == SLIME_DYNAMIC_FILTERS and name in SLIME_FILTERS
    out.spec["dynamic_sampling_filter_path"] = name if builtin else value


def _slime_default_or_spec(name: str, slime_default: str) -> Any:
    """A hook flag naming slime's own default is the spec's default (empty); another value is the spec key."""
    def convert(out: Conversion, value: Any) -> None:
        if value not in (None, slime_default):
            out.spec[spec_key(name)] = value
    return convert


def _custom_rm(out: Conversion, value: Any) -> None:
    if value == SLIME_OPD_REWARD:
        out.opd_reward = True  # resolved once --rm-url is known
    else:
        out.spec["custom_rm_path"] = value


def _reward_post_process(out: Conversion, value: Any) -> None:
    if value == SLIME_OPD_POST_PROCESS:
        out.opd_post_process = True
    else:
        out.spec["custom_reward_post_process_path"] = value


def _resolve_opd_reward(out: Conversion) -> None:
    """slime's sglang-type distillation is its reward function asking the teacher at --rm-url and its post-process
    keeping the teacher's log-probs with reward 0: here the rollout service asks the teacher (opd_teacher_url)."""
    if not out.opd_reward:
        out.refused.append(f"--custom-reward-post-process-path {SLIME_OPD_POST_PROCESS}: it reads the teacher's reply "
                           f"of --custom-rm-path {SLIME_OPD_REWARD}; give both (or neither)")
        return
    if "rm_url" not in out.spec:
        out.refused.append(f"--custom-rm-path {SLIME_OPD_REWARD}: needs --rm-url, the teacher's /generate URL")
        return
    out.spec["opd_teacher_url"] = out.spec.pop("rm_url")
    out.spec["opd_only"] = True  # the reward function's reply is the teacher's, which only the post-process reads
    reward = out.sources.pop("custom_rm_path", "--custom-rm-path")
    out.sources["opd_teacher_url"] = f"{out.sources.pop('rm_url')}, for {SLIME_OPD_REWARD} ({reward})"
    out.sources["opd_only"] = f"slime's on_policy_distillation reward ({reward})"
    out.notes.append(f"--custom-rm-path {SLIME_OPD_REWARD}: the rollout service asks the teacher at "
                     f"{out.spec['opd_teacher_url']} for each sample's log-probs (opd_teacher_url); rewards are 0 "
                     "(opd_only)")


def _no_advantages(out: Conversion, value: Any) -> None:
    out.no_advantages = True


def _custom_config(out: Conversion, value: Any) -> None:
    out.custom_config = str(value)  # read once every flag is converted: slime sets its keys after parsing


def _apply_custom_config(out: Conversion, value: str) -> None:
    """slime sets each key of the YAML file on args, over the flags: a spec key sets the spec, the others join
    plugin_args."""
    try:
        data = yaml.safe_load(Path(str(value)).read_text())
    except (OSError, yaml.YAMLError) as err:
        out.refused.append(f"--custom-config-path {value}: cannot read it: {err}")
        return
    if not isinstance(data, dict):
        out.refused.append(f"--custom-config-path {value}: expected a YAML mapping, got {type(data).__name__}")
        return
    for key, setting in data.items():
        key = str(key)
        (out.spec if key in out.spec_keys else out.plugin_args)[key] = setting
        out.sources[key] = f"{value}'s {key}, from {out.sources['custom_config_path']}"


def _num_epoch(out: Conversion, value: Any) -> None:
    out.num_epoch = int(value)  # resolved once prompt_data, rollout_batch_size and num_rollout are known


def _resolve_num_epoch(out: Conversion) -> None:
    """slime's num_rollout from num_epoch: epochs × (dataset rows // rollout_batch_size)."""
    if "num_rollout" in out.spec:
        out.notes.append("--num-epoch: ignored, num_rollout is given (as slime does)")
        return
    data, batch = str(out.spec.get("prompt_data", "")), out.spec.get("rollout_batch_size")
    try:
        if not batch:
            raise ValueError("needs rollout_batch_size")
        count = count_rows(data)
    except (OSError, ValueError) as err:
        out.refused.append(f"--num-epoch {out.num_epoch}: cannot count the prompts ({err}); give num_rollout")
        return
    out.spec["num_rollout"] = out.num_epoch * (count // int(batch))
    out.sources["num_rollout"] = f"--num-epoch {out.num_epoch} × ({count} prompts // {batch} per rollout)"
    out.notes.append(f"--num-epoch {out.num_epoch}: num_rollout {out.spec['num_rollout']} ({count} prompts, "
                     f"{batch} per rollout)")


def count_rows(spec: str) -> int:
    """The rows of a .jsonl (non-blank lines) or .parquet (its footer's row count) prompt file, after slime's
    `path@[start:end]` slice; ValueError for another format."""
    sliced = re.fullmatch(r"(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]", spec)
    path = Path(sliced["path"] if sliced else spec)
    rows = slice(*(int(x) if x else None for x in (sliced["start"], sliced["end"]))) if sliced else slice(None)
    if path.suffix == ".jsonl":
        with path.open("rb") as lines:
            count = sum(1 for line in lines if line.strip())
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            count = pq.ParquetFile(path).metadata.num_rows
        except pa.ArrowException as err:
            raise ValueError(f"{path}: cannot read parquet: {err}") from None
    else:
        raise ValueError(f"needs a .jsonl or .parquet prompt_data, got {path.suffix or 'no suffix'!r}")
    return len(range(count)[rows])


def _eval_config(out: Conversion, value: Any) -> None:
    out.eval_config = str(value)  # read once every other flag is converted: it checks against the job's keys


def _transport(out: Conversion, value: Any) -> None:
    """--update-weight-transport disk: engines pull from update_weight_disk_dir; nccl: weight_sync_backend's own."""
    out.plugin_args["update_weight_transport"] = value
    if value == "disk":
        out.spec["weight_sync_backend"] = "disk"
    elif value == "nccl":
        out.notes.append(f"--update-weight-transport nccl: {FLAGS['update-weight-transport'].note}")
    else:
        out.refused.append(f"--update-weight-transport {value}: expected nccl or disk")


_SPECIAL = {"update-weight-transport": _transport, "custom-rm-path": _custom_rm,
            "custom-reward-post-process-path": _reward_post_process,
            "rollout-function-path": _rollout_function, "disable-compute-advantages-and-returns": _no_advantages,
            "custom-config-path": _custom_config, "eval-config": _eval_config, "num-epoch": _num_epoch,
            "dynamic-sampling-filter-path": _dynamic_filter,
            "data-source-path": _slime_default_or_spec("data-source-path", FLAGS["data-source-path"].default),
            "buffer-filter-path": _slime_default_or_spec("buffer-filter-path", "slime.rollout.data_source.pop_first")}
# slime's sglang-type on-policy distillation: a reward function asking the teacher, a post-process keeping its log-probs
SLIME_OPD_REWARD = "slime.rollout.on_policy_distillation.reward_func"
SLIME_OPD_POST_PROCESS = "slime.rollout.on_policy_distillation.post_process_rewards"
# slime's dynamic-sampling filters, each a built-in of the rollout service under its own name
SLIME_DYNAMIC_FILTERS = "slime.rollout.filter_hub.dynamic_sampling_filters"
SLIME_FILTERS = ("check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback")
# slime's rollout functions -> the spec setting that does their job here
SLIME_ROLLOUTS = {"slime.rollout.sft_rollout.generate_rollout": ("loss_type", "sft_loss"),
                  "slime.rollout.fully_async_rollout.generate_rollout_fully_async": ("mode", "fully_async")}


def _convert_megatron(out: Conversion, name: str, value: Any) -> None:
    flag, key = MEGATRON[name], spec_key(name)
    out.plugin_args[key] = value
    if name in _SPEC_KEYS:
        out.spec[key] = "none" if value is None and name == "moe-router-load-balancing-type" else value  # a choice
    elif name in _LAYOUT_ONE:
        if value != 1:
            out.refused.append(f"--{name} {value}: {flag.note}")
    elif name == "optimizer":
        if value != "adam":
            out.refused.append(f"--optimizer {value}: {flag.note}")
    elif name == "lr-warmup-fraction":
        out.spec["lr_warmup_fraction"] = value  # resolved against the run's length in apply()
    elif flag.status == "refused":
        out.refused.append(f"--{name}: {flag.note}")
    elif flag.warn:
        out.notes.append(f"--{name}: {flag.note}")
    else:
        field_name = MEGATRON_FIELD.get(name, key)
        out.megatron[field_name] = (not value) if name in NEGATED else value


def megatron_only(conv: Conversion, rest: dict[str, Any]) -> list[str]:
    """The flags that became Megatron settings (the spec's `megatron:` section), named, when the job's train_backend
    takes none: what a script moved to another backend drops."""
    backend = rest.get("train_backend", conv.spec.get("train_backend"))
    try:
        if not conv.megatron or capabilities(str(backend)).extra_flags:
            return []
    except InvalidArgument:  # an unknown backend: the spec names it
        return []
    flag_of = {MEGATRON_FIELD.get(name, spec_key(name)): name for name in MEGATRON}
    flags = ", ".join(f"--{flag_of.get(key, key)}" for key in conv.megatron)
    return [f"{flags}: Megatron settings, which train_backend {backend} does not take; drop them"]


def apply(data: dict[str, Any], spec_keys: set[str]) -> dict[str, Any]:
    """A submitted spec with its `slime_args` converted: converted keys first, the spec's own keys over them.
    InvalidArgument lists every refused and unknown flag at once."""
    if "slime_args" not in data:
        return data
    rest = {k: v for k, v in data.items() if k != "slime_args"}
    argv = data["slime_args"]
    if not isinstance(argv, (str, list)):
        raise InvalidArgument(f"slime_args: expected a string or a list of arguments, got {type(argv).__name__}")
    conv = convert(argv, spec_keys=spec_keys, check_architecture=True,
                   hf_config=read_hf_config(rest["hf_checkpoint"]) if "hf_checkpoint" in rest else None)
    problems = conv.invalid + conv.refused + [f"{flag}: not a slime or Megatron flag Physarum knows"
                                              for flag in conv.unknown] + megatron_only(conv, rest)
    if problems:
        raise InvalidArgument("slime_args: " + "; ".join(problems))
    spec = {**conv.spec, **rest}
    sources = dict(conv.sources)
    for key in set(rest) & set(sources):
        sources[key] = f"the spec's own {key} (over {sources[key]})"
    warmup = spec.pop("lr_warmup_fraction", None)
    if warmup is not None and "lr_warmup_iters" not in rest:
        samples = int(spec["rollout_batch_size"]) * int(spec.get("n_samples_per_prompt", 1))
        steps = int(spec["num_rollout"]) * max(1, samples // int(spec.get("global_batch_size") or samples))
        spec["lr_warmup_iters"] = int(float(warmup) * steps)
        sources["lr_warmup_iters"] = f"{spec['lr_warmup_iters']} = lr_warmup_fraction × {steps} optimizer steps"
    if conv.megatron:
        spec["megatron"] = {**conv.megatron, **dict(rest.get("megatron") or {})}
    spec["plugin_args"] = {**conv.plugin_args, **dict(rest.get("plugin_args") or {})}
    spec["slime_notes"] = conv.notes
    spec["slime_sources"] = sources
    return spec
