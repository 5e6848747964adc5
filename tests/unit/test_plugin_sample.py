"""slime's Sample as plugins see it (services/common/plugin_sample.py, imported as slime.utils.types.Sample), and
the rest of the `slime` compatibility package."""

from __future__ import annotations

import asyncio
import types

import pytest

from services.common import plugins
from services.common.errors import InvalidArgument
from services.common.plugin_sample import PluginSample
from services.common.samples import Sample, Status
from testkit.images import png

plugins.ensure_slime_compat()


def test_slime_imports_resolve_to_physarums_classes():
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    from slime.rollout.rm_hub import async_rm, grade_answer_verl
    from slime.rollout.sglang_rollout import GenerateState  # noqa: F401 - importable is the point
    from slime.utils.http_utils import get, post  # noqa: F401
    from slime.utils.misc import load_function
    from slime.utils.types import Sample as SlimeSample

    from services.rollout.generation.filters import DynamicFilterOutput as Ours

    assert SlimeSample is PluginSample and DynamicFilterOutput is Ours
    assert load_function("slime.rollout.rm_hub.grade_answer_verl") is grade_answer_verl
    assert grade_answer_verl(r"so \boxed{\frac{1}{2}}", "0.5") is True
    args = types.SimpleNamespace(custom_rm_path=None, rm_type="math")
    assert asyncio.run(async_rm(args, SlimeSample(response=r"\boxed{4}", label="4"))) == 1
    assert asyncio.run(async_rm(args, SlimeSample(response="x", label="x", metadata={"rm_type": "f1"}))) == 1.0


def test_slimes_fields_and_defaults():
    sample = PluginSample()
    assert (sample.label, sample.reward, sample.loss_mask, sample.rollout_log_probs, sample.rollout_id) == \
        (None, None, None, None, None)
    assert (sample.group_index, sample.index, sample.remove_sample, sample.train_metadata) == (None, None, False, None)
    assert sample.Status.PENDING is Status.PENDING and isinstance(sample, Sample)
    for name in ("multimodal_inputs", "multimodal_train_inputs", "teacher_log_probs", "generate_function_path",
                 "custom_rm_path", "session_id", "rollout_top_p_token_ids", "rollout_routed_experts",
                 "apply_chat_template_kwargs", "non_generation_time", "spec_info", "prefix_cache_info"):
        assert hasattr(sample, name), name


def test_methods():
    sample = PluginSample(tokens=[1, 2], reward={"score": 0.5, "acc": True})
    assert sample.get_reward_value(types.SimpleNamespace(reward_key="score")) == 0.5
    assert sample.get_reward_value(types.SimpleNamespace(reward_key=None)) == {"score": 0.5, "acc": True}
    sample.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.1, -0.2], text="ab",
                                  meta_info={"finish_reason": {"type": "length"}, "cached_tokens": 1,
                                             "prompt_tokens": 2})
    sample.append_response_tokens(None, tokens=[5], trainable=False, text="c")
    assert (sample.tokens, sample.loss_mask, sample.rollout_log_probs, sample.response) == \
        ([1, 2, 3, 4, 5], [1, 1, 0], [-0.1, -0.2, 0.0], "abc")
    assert sample.status is Status.TRUNCATED and sample.effective_response_length == 2
    assert sample.prefix_cache_info.prefix_cache_hit_rate == 0.5
    data = sample.to_dict()
    assert data["status"] == "truncated" and data["prefix_cache_info"] == {"cached_tokens": 1,
                                                                         "total_prompt_tokens": 2}
    back = PluginSample.from_dict({**data, "custom_attr": 7})
    assert (back.tokens, back.status, back.custom_attr, back.prefix_cache_info.cached_tokens) == \
        ([1, 2, 3, 4, 5], Status.TRUNCATED, 7, 1)


def test_a_response_without_log_probs_cannot_take_trainable_ones_later():
    sample = PluginSample(tokens=[1, 2], response_length=1, loss_mask=None)
    with pytest.raises(InvalidArgument, match="whose earlier tokens have none"):
        sample.append_response_tokens(None, tokens=[3], log_probs=[-0.1])
    sample.append_response_tokens(None, tokens=[4], trainable=False)
    assert sample.loss_mask == [1, 0] and sample.rollout_log_probs == [0.0, 0.0]


def test_the_images_a_generate_function_adds_after_its_prompts_are_the_samples_own():
    """slime's multi-turn rollouts extend multimodal_inputs["images"] with each observation's (Pillow images): the
    finished sample keeps those after its prompt's, as checked PNGs of the same pixels; the prompt's stay the
    group's."""
    import io

    from PIL import Image as PILImage

    from services.common.images import check_image
    from services.common.plugin_sample import finish_plugin_sample

    prompt_image = check_image(png(4, 4, (255, 0, 0)))
    observed = PILImage.new("RGBA", (6, 2), (0, 0, 255, 255))
    sample = PluginSample(tokens=[1, 2, 3], response_length=1, loss_mask=[0], rollout_log_probs=[0.0],
                          prompt_messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                             "text": "?"}]}],
                          multimodal_inputs={"images": [prompt_image, observed], "videos": None})
    finish_plugin_sample(sample, needs_log_probs="", what="t")
    (own,) = sample.observation_images
    assert (own.mime_type, own.width, own.height) == ("image/png", 6, 2)
    assert PILImage.open(io.BytesIO(own.data)).convert("RGB").getpixel((5, 1)) == (0, 0, 255)
    text_only = PluginSample(tokens=[1, 2], response_length=1, multimodal_inputs={"images": None})
    assert finish_plugin_sample(text_only, needs_log_probs="", what="t").observation_images == []
    huge = PluginSample(tokens=[1, 2], response_length=1,
                        multimodal_inputs={"images": [PILImage.new("RGB", (5000, 5000))]})
    with pytest.raises(InvalidArgument, match="an image the generate function added: image of 5000x5000 pixels"):
        finish_plugin_sample(huge, needs_log_probs="", what="t")


def test_untrained_tokens_take_all_zero_log_probs():
    """slime refuses any log-probs for untrained tokens; its geo3k_vlm_multi_turn rollout passes zeros for each
    observation, which are what they get anyway: taken. Any other value stays refused."""
    sample = PluginSample(tokens=[1, 2], response_length=0)
    sample.append_response_tokens(None, tokens=[3], log_probs=[-0.5], trainable=True)
    sample.append_response_tokens(None, tokens=[4, 5], log_probs=[0.0, 0.0], trainable=False)
    assert sample.loss_mask == [1, 0, 0] and sample.rollout_log_probs == [-0.5, 0.0, 0.0]
    with pytest.raises(InvalidArgument, match="take no log_probs"):
        sample.append_response_tokens(None, tokens=[6], log_probs=[-0.1], trainable=False)
