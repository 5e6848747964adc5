"""Submit-time check that a job's samples fit the model's context: rollout_max_response_len alone, and each of the
first MAX_ROWS prompts' own tokens plus it, against max_position_embeddings of hf_checkpoint's config.json. The
prompts are counted as their bare text with the model's tokenizer (tokenizer.json): a chat template only adds
tokens, so a prompt refused here could never fit, and none that fits is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.trainer.api.spec import JobSpec

MAX_ROWS = 10_000  # rows read at submit; a longer dataset's later rows are left to the rollouts
MAX_BYTES = 64 << 20


def model_context(hf_checkpoint: str) -> int | None:
    try:
        config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _text(value: Any) -> str:
    """A row's prompt as text: a string, or a chat's message contents joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))
    return ""


def check_context(spec: JobSpec) -> list[str]:
    context = model_context(spec.hf_checkpoint)
    if context is None:
        return []
    response = spec.rollout.rollout_max_response_len
    if response >= context:
        return [f"rollout_max_response_len: {response} tokens leave no room for a prompt in the model's context of "
                f"{context} tokens (max_position_embeddings of {spec.hf_checkpoint})"]
    tokenizer_file = Path(spec.hf_checkpoint) / "tokenizer.json"
    path = Path(spec.prompt_data.split("@[", 1)[0])
    if spec.train_only or not tokenizer_file.is_file() or path.suffix != ".jsonl" or not path.is_file():
        return []
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    key, budget = spec.rollout.input_key, context - response
    read = 0
    with open(path, encoding="utf-8", errors="replace") as rows:
        for index, line in enumerate(rows):
            read += len(line)
            if index >= MAX_ROWS or read > MAX_BYTES:
                break
            try:
                row = json.loads(line)
            except ValueError:
                continue  # the buffer reports bad rows when it loads the dataset
            text = _text(row.get(key)) if isinstance(row, dict) else ""
            if len(text.encode()) + 1 < budget:  # a token covers a byte or more (one more: a leading marker)
                continue
            if (tokens := len(tokenizer.encode(text, add_special_tokens=False).ids)) > budget:
                return [f"prompt_data: row {index}'s prompt is {tokens} tokens; with rollout_max_response_len "
                        f"{response} it exceeds the model's context of {context} tokens; shorten the prompts or "
                        f"lower rollout_max_response_len"]
    return []
