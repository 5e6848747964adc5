"""Multi-turn SFT loss masks (slime's loss_mask_type): only assistant turns train, with a Qwen-style chat template
that adds a default system prompt to a lone message (what the qwen masks must cut off)."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer

from services.common.errors import InvalidArgument
from services.common.plugin_sample import PluginSample
from services.rollout.generation.loss_masks import LossMasker, conversation_sample, response_length
from services.rollout.generation.prompts import PromptEncoder

QWEN25_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n42<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25_TEMPLATE}))
    return tmp_path


def trained_spans(tokenizer: Tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    spans, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    return spans + ([tokenizer.decode(current, skip_special_tokens=False)] if current else [])


@pytest.mark.parametrize("kind", ["qwen", "qwen3"])
def test_only_assistant_turns_train_and_the_tokens_are_the_whole_chat(model, kind):
    encoder = PromptEncoder(model)
    ids, mask = LossMasker(encoder, kind).tokens_and_mask(CHAT)
    whole = encoder.chat_template.render(messages=CHAT, add_generation_prompt=False, **encoder.special_tokens)
    assert ids == encoder.encode_text(whole)  # the default system prompt once, at the start
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert [s.replace(" ", "") for s in trained_spans(tokenizer, ids, mask)] == ["2<|im_end|>\n", "5<|im_end|>\n"]


def test_step_loss_mask_and_distill(model):
    encoder = PromptEncoder(model)
    chat = [*CHAT[:3], {**CHAT[3], "step_loss_mask": 0}]
    _, mask = LossMasker(encoder, "qwen").tokens_and_mask(chat)
    assert response_length(mask) == len(mask) - mask.index(1) and sum(mask) == 3  # "2", <|im_end|>, "\n"
    ids, mask = LossMasker(encoder, "distill").tokens_and_mask([CHAT[0], CHAT[3]])
    prompt = encoder.chat_template.render(messages=CHAT[:1], add_generation_prompt=True, **encoder.special_tokens)
    assert ids == encoder.encode_text(prompt) + encoder.encode_text("5") and mask == [0] * (len(ids) - 1) + [1]


def test_conversation_sample_is_slimes_sft_sample(model):
    encoder = PromptEncoder(model)
    sample = conversation_sample(PluginSample(group_index=0, index=0), encoder, CHAT, "qwen")
    ids, mask = LossMasker(encoder, "qwen").tokens_and_mask(CHAT)
    n = response_length(mask)
    assert (sample.tokens, sample.response_length, sample.loss_mask) == (ids, n, mask[-n:])
    assert sample.loss_mask[0] == 1 and 0 in sample.loss_mask  # the second user turn inside the response: masked
    assert sample.rollout_log_probs == [0.0] * n and sample.reward == 0.0
    with pytest.raises(InvalidArgument, match="no assistant tokens to train on"):
        conversation_sample(PluginSample(group_index=3), encoder, [{**CHAT[1], "step_loss_mask": 0}], "qwen")
    with pytest.raises(InvalidArgument, match="loss_mask_type 'glm4': expected one of qwen, qwen3, qwen3_5, distill"):
        LossMasker(encoder, "glm4")


# Qwen3.5's: an assistant turn opens with a thinking block (empty here), and no default system prompt
QWEN35_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "<think>\n\n</think>\n\n{% endif %}{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_qwen3_5_trains_each_assistant_turn_after_its_think_opening_through_its_end(model):
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN35_TEMPLATE}))
    encoder = PromptEncoder(model)
    chat = [*CHAT[:3], {**CHAT[3], "step_loss_mask": 0}, {"role": "user", "content": "3+4="},
            {"role": "assistant", "content": "7"}]
    ids, mask = LossMasker(encoder, "qwen3_5").tokens_and_mask(chat)
    whole = encoder.chat_template.render(messages=chat, add_generation_prompt=False, **encoder.special_tokens)
    assert ids == encoder.encode_text(whole)
    # the turn whose step_loss_mask is 0 trains nothing; the others from after "<think>\n" through "<|im_end|>\n"
    # (read through the tokens' characters: the demo's tokenizer has no "<" or ">" of its own; its one token for
    # "\n\n" straddles the turn's start and trains, as in slime, where a token trains if any of its characters does)
    offsets = Tokenizer.from_file(str(model / "tokenizer.json")).encode(whole, add_special_tokens=False).offsets
    spans, previous = [], 0
    for (start, end), trained in zip(offsets, mask, strict=True):
        if trained:
            spans[-1:] = [spans[-1] + whole[start:end]] if previous else [*spans[-1:], whole[start:end]]
        previous = trained
    assert spans == ["\n\n</think>\n\n2<|im_end|>\n", "\n\n</think>\n\n7<|im_end|>\n"]
