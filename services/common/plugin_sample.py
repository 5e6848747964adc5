"""The Sample that plugins see: slime's `Sample` (its fields, defaults, nested `Status`, methods), a subclass of the
core record so the services keep handling it as one. `slime.utils.types.Sample` is this class.

slime leaves loss_mask, rollout_log_probs and reward at None until something sets them; `finish_plugin_sample`
turns what a generate function returned back into a core record (or refuses it, saying why), the images its turns
added (multimodal_inputs) kept as the sample's observation_images.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.common.errors import InvalidArgument
from services.common.images import MAX_IMAGES_PER_ROW, encoded_image
from services.common.samples import Image, Sample, Status, count_image_parts

# meta_info key the rollout adds: the pool's settled weight version when a request was sent (the engine's
# weight_version is the one it ended with; an update in between makes the tokens span both).
START_VERSION_KEY = "physarum_start_weight_version"
_SLIME_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
# metadata key holding the attributes a plugin set on its sample beyond slime's fields (retool's tool_call_count):
# in slime they reach the reward function on the same object; here they travel with the sample.
PLUGIN_ATTRS_KEY = "slime_sample_attrs"


@dataclass
class SpecInfo:
    """slime's speculative-decoding counters of one sample."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

    def add(self, meta_info: dict) -> None:
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> SpecInfo:
        return SpecInfo(**{f.name: data.get(f.name, 0) for f in dataclasses.fields(SpecInfo)})


@dataclass
class PrefixCacheInfo:
    """slime's prefix-cache counters of one sample (SGLang's cached_tokens / prompt_tokens)."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

    def add(self, meta_info: dict) -> None:
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> PrefixCacheInfo:
        return PrefixCacheInfo(**{f.name: data.get(f.name, 0) for f in dataclasses.fields(PrefixCacheInfo)})


@dataclass
class PluginSample(Sample):
    """slime's Sample. Fields slime has and the core record lacks live here; the ones both have take slime's
    defaults (None where slime says None)."""

    Status: ClassVar[type[Status]] = Status
    SpecInfo: ClassVar[type[SpecInfo]] = SpecInfo
    PrefixCacheInfo: ClassVar[type[PrefixCacheInfo]] = PrefixCacheInfo

    group_index: int | None = None
    index: int | None = None
    label: Any = None
    reward: Any = None  # a float, a dict (reward_key picks), or None: not scored yet
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    teacher_log_probs: list[float] | None = None
    custom_rm_path: str | None = None
    generate_function_path: str | None = None
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    session_id: str | None = None  # the routing key under a sticky router policy
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def get_reward_value(self, args: Any) -> Any:
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """slime's signature and checks; `args` is used only for speculative-decoding counters."""
        append_response_tokens(self, tokens, log_probs=log_probs, trainable=trainable, meta_info=meta_info,
                               text=text, update_terminal_info=update_terminal_info)
        meta_info = meta_info or {}
        if update_terminal_info and "finish_reason" in meta_info:
            if getattr(args, "sglang_speculative_algorithm", None):
                self.spec_info.add(meta_info)
            self.prefix_cache_info.add(meta_info)

    def to_dict(self) -> dict[str, Any]:
        value = self.__dict__.copy()
        value["status"] = self.status.name.lower()  # slime's Status values: "pending", "completed", ...
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict) -> PluginSample:
        """slime's from_dict: unknown keys become attributes."""
        data = dict(data)
        status = data.get("status", "pending")
        data["status"] = Status(status) if isinstance(status, int) else Status[str(status).upper()]
        data["spec_info"] = SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = PrefixCacheInfo.from_dict(data.get("prefix_cache_info") or {})
        names = {f.name for f in dataclasses.fields(PluginSample)}
        sample = PluginSample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    @classmethod
    def from_record(cls, sample: Sample) -> PluginSample:
        """A plugin's view of a core record (same field values, and the attributes its generate function set)."""
        if isinstance(sample, cls):
            return sample
        out = cls(**{f.name: getattr(sample, f.name) for f in dataclasses.fields(Sample)})
        out.metadata = dict(sample.metadata)
        for name, value in (out.metadata.pop(PLUGIN_ATTRS_KEY, None) or {}).items():
            setattr(out, name, value)
        return out


def _int_list(values: Any) -> list[int]:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(v) for v in values]


def _flat_int_list(values: Any) -> list[int]:
    """slime keeps routed experts as a [tokens - 1, layers, top-k] tensor (or nested lists); the record, flat."""
    if values is None:
        return []
    if hasattr(values, "reshape"):
        return [int(v) for v in values.reshape(-1).tolist()]
    flat: list[int] = []
    for value in values:
        flat.extend(_flat_int_list(value) if isinstance(value, (list, tuple)) else [int(value)])
    return flat


def append_response_tokens(sample: Sample, tokens: Any, *, log_probs: Any = None, trainable: bool = True,
                           meta_info: dict | None = None, text: str | None = None,
                           update_terminal_info: bool = True) -> None:
    """Extend the response as slime's Sample.append_response_tokens does: model tokens (trainable) need their
    log-probs and get loss_mask 1; tool or environment tokens get loss_mask 0 and log-prob 0. A loss_mask or
    rollout_log_probs still None is started for the response so far (all 1s, all 0s). A segment with tokens
    records meta_info's weight_version; with update_terminal_info, finish_reason sets the status."""
    tokens = _int_list(tokens)
    log_probs = None if log_probs is None else [float(v) for v in (
        log_probs.tolist() if hasattr(log_probs, "tolist") else log_probs)]
    if log_probs is not None and len(log_probs) != len(tokens):
        raise InvalidArgument(f"append_response_tokens: {len(log_probs)} log_probs for {len(tokens)} tokens")
    if tokens and trainable and log_probs is None:
        raise InvalidArgument("append_response_tokens: trainable tokens need their log_probs")
    if tokens and not trainable:
        # slime refuses any; all zeros are what they get anyway (slime's geo3k_vlm_multi_turn rollout.py passes them
        # for each observation, and raises there under slime's own Sample)
        if log_probs is not None and any(log_probs):
            raise InvalidArgument("append_response_tokens: tokens that are not trainable take no log_probs "
                                  "(they get 0)")
        log_probs = [0.0] * len(tokens)
    before = sample.response_length
    if log_probs is not None and trainable and before and sample.rollout_log_probs is None:
        raise InvalidArgument("append_response_tokens: cannot append trainable log_probs to a response whose "
                              "earlier tokens have none")
    if text is not None:
        sample.response += text
    # Lists grow in place, as in slime: plugins keep references to them (retool's `loss_masks = sample.loss_mask`).
    if tokens:
        sample.tokens += tokens
        sample.response_length += len(tokens)
        if sample.loss_mask is None:
            sample.loss_mask = [1] * before
        sample.loss_mask += [int(trainable)] * len(tokens)
    if log_probs is not None:
        if sample.rollout_log_probs is None:
            sample.rollout_log_probs = [0.0] * before
        sample.rollout_log_probs += log_probs
    meta_info = meta_info or {}
    if tokens and meta_info.get("weight_version") is not None:
        # A request that crossed a weight update records the version it started with too: its oldest tokens'.
        end, start = str(meta_info["weight_version"]), meta_info.get(START_VERSION_KEY)
        sample.weight_versions = [*sample.weight_versions, *([str(start)] if start not in (None, end) else []), end]
    finish = (meta_info.get("finish_reason") or {}).get("type")
    if update_terminal_info and finish in _SLIME_STATUS:
        sample.status = _SLIME_STATUS[finish]


def finish_plugin_sample(sample: Sample, *, needs_log_probs: str, what: str) -> Sample:
    """A generate function's sample as a core record, in place: loss_mask None -> all ones, rollout_log_probs None
    -> none (refused when `needs_log_probs` names the setting that uses them), remove_sample -> loss_mask all 0,
    a PENDING status -> COMPLETED. InvalidArgument when the lengths disagree."""
    n = sample.response_length
    if sample.loss_mask is None:
        sample.loss_mask = [1] * n
    if sample.rollout_log_probs is None:
        if needs_log_probs and n:
            raise InvalidArgument(f"{what}: the generate function left rollout_log_probs None, but {needs_log_probs} "
                                  f"trains on the engines' log-probs (send return_logprob and keep them)")
        sample.rollout_log_probs = []
    if sample.teacher_log_probs is None:
        sample.teacher_log_probs = []
    sample.rollout_routed_experts = _flat_int_list(sample.rollout_routed_experts)
    if sample.remove_sample:
        sample.loss_mask = [0] * n
    for name in ("custom_rm_path", "generate_function_path"):
        if getattr(sample, name) is None:
            setattr(sample, name, "")
    sample.group_index = sample.group_index or 0
    sample.index = sample.index or 0
    log_probs = len(sample.rollout_log_probs)
    if not (len(sample.loss_mask) == n < len(sample.tokens)) or log_probs not in (0, n):
        raise InvalidArgument(f"{what}: response_length {n} with {len(sample.loss_mask)} loss_mask, {log_probs} "
                              f"rollout_log_probs and {len(sample.tokens)} tokens (use sample.append_response_tokens)")
    if sample.status == Status.PENDING:
        sample.status = Status.COMPLETED
    added = observation_images(sample, what)
    if added:  # (a sample given back to a later rollout keeps those it added before)
        sample.observation_images = added
    extras = _plugin_attrs(sample)
    if extras:
        sample.metadata = {**sample.metadata, PLUGIN_ATTRS_KEY: extras}
    return sample


def observation_images(sample: Sample, what: str) -> list[Image]:
    """The images a generate function added to the sample after its prompt's (slime's multi-turn rollouts extend
    multimodal_inputs["images"] with each observation's), encoded once (services/common/images.py)."""
    images = (getattr(sample, "multimodal_inputs", None) or {}).get("images")
    if not images:  # a text sample's cost: this lookup
        return []
    added = list(images)[count_image_parts(sample.prompt_messages):]
    if len(added) > MAX_IMAGES_PER_ROW:
        raise InvalidArgument(f"{what}: {len(added)} images added by the generate function (at most "
                              f"{MAX_IMAGES_PER_ROW})")
    try:
        return [encoded_image(image) for image in added]
    except ValueError as err:
        raise InvalidArgument(f"{what}: an image the generate function added: {err}") from None


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _plugin_attrs(sample: Sample) -> dict[str, Any]:
    """The JSON-representable attributes set on the sample beyond its dataclass fields."""
    names = _field_names(type(sample))
    extras = {}
    for name, value in vars(sample).items():
        if name in names or name.startswith("_"):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        extras[name] = value
    return extras
