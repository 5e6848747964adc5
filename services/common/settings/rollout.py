"""The rollout's settings of a job (`RolloutConfig`): slime's rollout flags, each a job-spec key declared here once,
checked where they are made. The rollout manager runs with them; the trainer's settings share some of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from services.common.config import NON_NEGATIVE, POSITIVE, PROBABILITY, REQUIRED, check_fields, field
from services.common.errors import InvalidArgument
from services.common.samples import MULTIMODAL_PLACEHOLDERS
from services.common.settings.rewards import check_rm_type

LossType = Literal["policy_loss", "sft_loss", "custom_loss"]
# an eval dataset's own settings (slime's eval config names) -> the RolloutConfig field each replaces for it
EVAL_DATASET_SETTINGS = {"n_samples_per_eval_prompt": "n_samples_per_eval_prompt", "temperature": "eval_temperature",
                         "top_p": "eval_top_p", "top_k": "eval_top_k", "max_response_len": "eval_max_response_len",
                         "input_key": "eval_input_key", "label_key": "eval_label_key", "metadata_key": "metadata_key",
                         "rm_type": "rm_type", "custom_rm_path": "custom_rm_path"}


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """What the manager needs to know of a job (proto RolloutConfig). Field names are slime's flags; each setting's
    declaration here (default, help, rule) is the job spec's, and the trainer's TrainConfig shares the ones it needs.
    """

    job_id: str = field("", "the job's id", internal=True)
    tokenizer_path: str = field("", "the tokenizer (the job's hf_checkpoint; empty: the engines' model directory)",
                                internal=True)
    args: dict[str, Any] = field({}, "the whole job spec, for plugins (slime's `args`)", internal=True)
    rollout_batch_size: int = field(REQUIRED, "prompts (groups) per rollout", POSITIVE)
    n_samples_per_prompt: int = field(1, "samples per prompt; consecutive samples form one reward group", POSITIVE)
    rollout_temperature: float = field(1.0, "sampling temperature (the trainer divides logits by it too)",
                                       NON_NEGATIVE)
    rollout_top_p: float = field(1.0, "nucleus sampling threshold", PROBABILITY)
    rollout_top_k: int = field(-1, "top-k sampling (-1: off)")
    rollout_max_response_len: int = field(1024, "most tokens generated per sample", POSITIVE)
    rollout_stop: list[str] = field([], "stop strings")
    rollout_stop_token_ids: list[int] = field([], "stop token ids")
    rm_type: str = field("math", "built-in reward, slime's rm_hub: math, deepscaler, dapo, f1, gpqa, remote_rm, random "
                                 "(a boxed_ prefix scores the last \\boxed{}), or exact_match; a sample's "
                                 "metadata.rm_type wins")
    custom_rm_path: str = field("", "import path of async def reward(args, sample) -> float (or dict)")
    reward_key: str = field("", "train on sample.reward_scores[reward_key] when a reward function returns a dict")
    rm_url: str = field("", "rm_type remote_rm: the reward model's HTTP endpoint (POST prompt, response, label)")
    loss_mask_type: Literal["qwen", "qwen3", "qwen3_5", "distill"] = field(
        "qwen", "sft_loss on conversations: how the chat template marks the assistant turns that train")
    reward_timeout_s: float = field(10.0, "seconds a sample's reward may take", POSITIVE)
    loss_type: LossType = field("policy_loss", "policy_loss (RL), sft_loss (NLL of prompt + label, no generation) "
                                               "or custom_loss")
    # The job spec's user-facing default (slime has no such flag): a lease not acked in this time goes back.
    lease_timeout_s: float = field(60.0, "seconds before a leased prompt goes back to the buffer", POSITIVE)
    over_sampling_batch_size: int | None = field(
        None, "groups leased per refill, >= rollout_batch_size (None or 0: the missing ones)")
    dynamic_sampling_filter_path: str = field(
        "", "fn(args, samples) -> DynamicFilterOutput | bool, or a built-in filter's name")
    partial_rollout: bool = field(False, "groups aborted once the batch is full keep their tokens for the next "
                                         "rollout")
    mask_offpolicy_in_partial_rollout: bool = field(False, "an earlier rollout's tokens get loss_mask 0")
    custom_generate_function_path: str = field("", "async def generate(args, sample, sampling_params) -> Sample")
    group_rm: bool = field(False, "custom_rm_path is async def f(args, samples) -> list[float], once per group")
    eval_prompt_data: list[str] = field([], "eval datasets as name=path (slime's name path pairs are accepted)")
    n_samples_per_eval_prompt: int = field(1, "samples per eval prompt", POSITIVE)
    eval_temperature: float | None = field(None, "eval sampling temperature (None: rollout_temperature)",
                                           NON_NEGATIVE)
    eval_top_p: float | None = field(None, "eval nucleus threshold (None: rollout_top_p)", PROBABILITY)
    eval_max_response_len: int | None = field(None, "eval response limit (None: rollout_max_response_len)",
                                              POSITIVE)
    eval_top_k: int | None = field(None, "eval top-k sampling (None: rollout_top_k; -1: off)")
    eval_input_key: str | None = field(None, "the prompt's key in the eval datasets (None: input_key)")
    eval_label_key: str | None = field(None, "the label's key in the eval datasets (None: label_key)")
    eval_dataset_settings: dict[str, dict[str, Any]] = field(
        {}, "per eval dataset (by name), settings of its own over the eval_* keys, as slime's --eval-config datasets "
            "set them: " + ", ".join(EVAL_DATASET_SETTINGS))
    input_key: str = field("input", "the prompt's key in each data row")
    label_key: str = field("label", "the label's key in each data row (slime's default)")
    metadata_key: str = field("metadata", "the metadata's key in each data row")
    apply_chat_template: bool = field(False, "wrap each prompt in the tokenizer's chat template")
    multimodal_keys: dict[str, str] = field(
        {}, "slime's multimodal keys: modality -> the data rows' column of its items, e.g. {\"image\": \"images\"}; "
            "each <image> in a prompt becomes an image part, filled in order from that column (a file under the data "
            "roots, relative to the dataset's folder; a data: URL; base64; bytes), every image read and checked when "
            "the dataset loads")
    max_inflight_groups: int | None = field(
        None, "fully_async: groups generating or waiting (None: rollout_batch_size); > 0 makes the manager stream")
    agent_function_path: str = field(
        "", "import path of async def agent(base_url, api_key, prompt) -> float | None, run per sample against its "
            "own session of the agent gateway (OpenAI and Anthropic APIs); a float return is the sample's reward")
    agent_timeout_s: float = field(600.0, "seconds an agent may run; its session then ends and the sample is the "
                                          "trajectory so far, truncated", POSITIVE)
    use_rollout_routing_replay: bool = field(
        False, "MoE (slime's R3): the engines return the experts they routed each token to, and the trainer's "
               "forwards route every token to those experts (implies use_routing_replay)")

    opd_teacher_url: str = field(
        "", "on-policy distillation (use_opd, opd_type sglang): the teacher's SGLang /generate URL; the rollout "
            "service asks it for its log-probs of each sample's response tokens (prefill only), which become the "
            "sample's teacher_log_probs (slime sends its on_policy_distillation reward to --rm-url)")
    opd_only: bool = field(False, "on-policy distillation alone: every sample's reward is 0 and no reward is "
                                  "computed, the teacher's log-probs are the only signal (what slime's "
                                  "on_policy_distillation reward and post-process give)")
    rollout_function_path: str = field(
        "", "import path of slime's def generate_rollout(args, rollout_id, data_source, evaluation=False) -> groups of "
            "Samples (or RolloutFnTrainOutput): the rollout service runs it once per rollout, in a worker thread, in "
            "place of its own loop, against data_source_path's data source; each group must answer a prompt that "
            "data source leased from the buffer; a sample with reward None is scored by the job's reward, one "
            "without weight versions gets the rollout's (empty: the service's own loop)")
    data_source_path: str = field(
        "", "import path of a class of slime's DataSource interface (get_samples, add_samples, save, load), built "
            "with `args` once per job in the rollout service and given to the rollout function (rollout_function_path, "
            "else slime's default generate_rollout: over-sampling, dynamic filter, partial groups given back); its "
            "base classes are slime.rollout.data_source's (empty: RolloutDataSourceWithBuffer, which leases the "
            "job's prompts from the buffer and keeps given-back groups with their leases); a class that is not "
            "RolloutDataSource or a subclass makes its own prompts: what its get_samples yields is stored in the "
            "buffer at its position when the buffer runs short (in place of prompt_data's), and the rollout "
            "function gets RolloutDataSourceWithBuffer over them; as slime, the service calls load(rollout_id - 1) "
            "when it builds it (again when the trainer resumed) and save(rollout_id) after a rollout the trainer "
            "checkpoints (save, save_interval, the last)")
    buffer_filter_path: str = field(
        "", "import path of slime's def buffer_filter(args, rollout_id, buffer, num_samples) -> groups: which "
            "groups given back to the data source (add_samples) get_samples takes, removing them from `buffer` "
            "(empty: slime's pop_first); like data_source_path, it makes the rollout a rollout function's")
    eval_function_path: str = field(
        "", "import path of slime's eval function, generate_rollout(args, rollout_id, data_source, evaluation=True) "
            "-> RolloutFnEvalOutput (or its data dict): at each eval the rollout service runs it in a worker thread "
            "(empty: rollout_function_path's, as slime defaults it, else the service's own eval); its data's "
            "{dataset: {rewards, truncated}} become eval/<dataset> (mean reward), -truncated_ratio and -pass@k (by "
            "the dataset's n_samples_per_eval_prompt), its numeric metrics join them")

    def __post_init__(self) -> None:
        if not self.job_id:
            raise InvalidArgument("rollout config: job_id must not be empty")
        check_fields(self, InvalidArgument, "rollout config")
        fallbacks = {"eval_temperature": self.rollout_temperature, "eval_top_p": self.rollout_top_p,
                     "eval_max_response_len": self.rollout_max_response_len, "over_sampling_batch_size": 0,
                     "eval_top_k": self.rollout_top_k, "eval_input_key": self.input_key,
                     "eval_label_key": self.label_key,
                     "max_inflight_groups": 0}
        for name, value in fallbacks.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.over_sampling_batch_size and self.over_sampling_batch_size < self.rollout_batch_size:
            raise InvalidArgument(f"rollout config: over_sampling_batch_size ({self.over_sampling_batch_size}) must "
                                  f"be >= rollout_batch_size ({self.rollout_batch_size}), or 0")
        if self.max_inflight_groups < 0:
            raise InvalidArgument(f"rollout config: max_inflight_groups must be >= 0, got {self.max_inflight_groups}")
        if 0 < self.max_inflight_groups < self.rollout_batch_size:
            raise InvalidArgument(f"rollout config: max_inflight_groups ({self.max_inflight_groups}) must be >= "
                                  f"rollout_batch_size ({self.rollout_batch_size})")
        for modality, column in self.multimodal_keys.items():
            if modality not in MULTIMODAL_PLACEHOLDERS:
                raise InvalidArgument(f"rollout config: multimodal_keys: modality {modality!r} is not supported "
                                      f"(supported: {', '.join(MULTIMODAL_PLACEHOLDERS)})")
            if not isinstance(column, str) or not column:
                raise InvalidArgument(f"rollout config: multimodal_keys: {modality!r} must name a column, got "
                                      f"{column!r}")
        if self.multimodal_keys and (names := [name for name in ("rollout_function_path", "data_source_path")
                                               if getattr(self, name)]):
            raise InvalidArgument(f"rollout config: multimodal_keys: {', '.join(names)} would make groups without "
                                  "their prompts' images; prompts with images run the service's own rollout loop (a "
                                  "custom_generate_function_path or an agent_function_path is fine)")
        if self.use_rollout_routing_replay and self.agent_function_path:
            raise InvalidArgument("rollout config: use_rollout_routing_replay needs the engines' routed experts, "
                                  "which agent sessions do not record; use use_routing_replay")
        if self.max_inflight_groups and self.partial_rollout:
            raise InvalidArgument("rollout config: partial_rollout does not apply to a fully_async stream (it never "
                                  "aborts groups to end a batch)")
        for entry in self.eval_prompt_data:
            name, _, path = entry.partition("=")
            if not name or not path:
                raise InvalidArgument(f"rollout config: eval_prompt_data entry {entry!r} is not 'name=path'")
        for name in self.eval_dataset_settings:
            if name not in self.eval_datasets:
                raise InvalidArgument(f"rollout config: eval_dataset_settings names {name!r}, which is not an eval "
                                      f"dataset ({', '.join(self.eval_datasets) or 'none'})")
            if self.eval_dataset_settings[name]:
                self.for_eval_dataset(name)
        if not self.custom_rm_path:
            if self.rm_type:
                check_rm_type(self.rm_type, where="rollout config")
            if self.rm_type.removeprefix("boxed_") == "remote_rm" and not self.rm_url:
                raise InvalidArgument("rollout config: rm_type remote_rm needs rm_url (the reward model's HTTP "
                                      "endpoint)")
        if self.group_rm and not self.custom_rm_path:
            raise InvalidArgument("rollout config: group_rm needs custom_rm_path (async def f(args, samples) -> "
                                  "list[float])")
        if self.agent_function_path and (self.custom_generate_function_path or self.partial_rollout):
            raise InvalidArgument("rollout config: agent_function_path runs the agent as the sample's generate "
                                  "function: leave custom_generate_function_path empty and partial_rollout off (an "
                                  "agent does not resume an aborted session)")
        if self.opd_teacher_url and not self.opd_teacher_url.startswith(("http://", "https://")):
            raise InvalidArgument(f"rollout config: opd_teacher_url must be an http(s) URL of the teacher's "
                                  f"/generate, got {self.opd_teacher_url!r}")
        self._check_rollout_function()
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise InvalidArgument("rollout config: mask_offpolicy_in_partial_rollout needs partial_rollout")

    @property
    def uses_data_source(self) -> bool:
        """The rollout is a rollout function's (the user's, or slime's default over data_source_path's data source
        or buffer_filter_path), not the service's own loop."""
        return bool(self.rollout_function_path or self.data_source_path or self.buffer_filter_path)

    def _check_rollout_function(self) -> None:
        if not self.uses_data_source:
            return
        clash = [name for name, on in (("a fully_async stream (max_inflight_groups > 0)", self.max_inflight_groups),
                                       ("agent_function_path", self.agent_function_path)) if on]
        if clash:
            raise InvalidArgument(f"rollout config: rollout_function_path, data_source_path and buffer_filter_path "
                                  f"run a rollout function in place of the service's loop, which does not take "
                                  f"{' or '.join(clash)}")

    @property
    def eval_datasets(self) -> dict[str, str]:
        """eval_prompt_data as {name: path}, in order."""
        return dict(entry.split("=", 1) for entry in self.eval_prompt_data)

    def for_eval_dataset(self, name: str) -> RolloutConfig:
        """This config with eval dataset `name`'s own settings (eval_dataset_settings) over the eval_* keys; checked
        as any config is (a bad rm_type fails naming it)."""
        settings = self.eval_dataset_settings.get(name) or {}
        unknown = sorted(set(settings) - set(EVAL_DATASET_SETTINGS))
        if unknown:
            raise InvalidArgument(f"rollout config: eval_dataset_settings[{name!r}]: unknown settings {unknown}; "
                                  f"expected {', '.join(EVAL_DATASET_SETTINGS)}")
        hints = {f.name: f.type for f in dataclasses.fields(RolloutConfig)}
        values = {}
        for key, value in settings.items():
            if value is None:
                continue
            target = EVAL_DATASET_SETTINGS[key]
            integral = "int" in str(hints[target]) and isinstance(value, float) and value.is_integer()
            values[target] = int(value) if integral else value  # a proto Struct carries numbers as floats
        try:
            return dataclasses.replace(self, eval_dataset_settings={}, **values)
        except InvalidArgument as err:
            raise InvalidArgument(f"rollout config: eval_dataset_settings[{name!r}]: "
                                  f"{str(err).removeprefix('rollout config: ')}") from None
