"""PromptEncoder: chat rendering and tokenization match transformers' without importing it in the service."""

from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Prompt
from services.rollout.generation.prompts import PromptEncoder

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+3="}]


def test_chat_prompt_matches_transformers_apply_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    text, ids = PromptEncoder(tiny_model_dir).encode(Prompt(job_id="j", index=0, epoch=0, messages=MESSAGES))
    assert text == expected and text.endswith("<|im_start|>assistant\n")
    assert ids == reference(expected, add_special_tokens=False)["input_ids"]
    assert ids[0] == reference.convert_tokens_to_ids("<|im_start|>")


def test_plain_prompt_is_tokenized_as_is_and_decodes_back(tiny_model_dir):
    encoder = PromptEncoder(tiny_model_dir)
    text, ids = encoder.encode(Prompt(job_id="j", index=0, epoch=0, prompt="12+34="))
    assert text == "12+34=" and len(ids) == 6 and encoder.decode(ids) == "12+34="
    assert encoder.decode([*ids, encoder.eos_token_id]) == "12+34="  # special tokens skipped
    assert encoder.eos_token_id == 0  # the tiny model: eos = pad = "<|endoftext|>" id 0


def test_template_from_tokenizer_config_and_eos_list(tiny_model_dir, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    encoder = PromptEncoder(tmp_path)
    assert encoder.render(Prompt(job_id="j", index=0, epoch=0, messages=MESSAGES[1:])) == '[user]"12+3="'
    assert encoder.eos_token_id == 2


def test_chat_prompt_without_template_and_missing_tokenizer_are_named(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(InvalidArgument, match="prompt 4 of job j is a chat, but .* has no chat template"):
        PromptEncoder(tmp_path).render(Prompt(job_id="j", index=4, epoch=0, messages=MESSAGES))
    with pytest.raises(InvalidArgument, match="no tokenizer.json"):
        PromptEncoder(tmp_path / "missing")
