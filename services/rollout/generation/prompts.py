"""Turn a Prompt into the text and token ids sent to the engines, without torch or transformers.

Chat prompts are rendered with the model's own template (jinja2, as Hugging Face does); tokens come from the
`tokenizers` library. The engine knows nothing about chat templates; this module nothing about generation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.errors import InvalidArgument
from services.common.samples import Prompt
from services.rollout.generation.image_tokens import ImageTokens


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str:
    """A tokenizer_config special token: a string or an AddedToken dict {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class PromptEncoder:
    """Renders and tokenizes prompts for one HF model directory (tokenizer.json, chat template, eos)."""

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not (path / "tokenizer.json").exists():
            raise InvalidArgument(f"tokenizer path {path}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        self.special_tokens = {key: _token_text(tokenizer_config.get(key))
                               for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = tokenizer_config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.path = path
        self.chat_template = _compile(template) if isinstance(template, str) else None
        self.eos_token_id = self._find_eos_token_id(path)
        self.context_len = model_context_len(path)
        self.image_tokens = ImageTokens.load(path)  # None: a text model

    def _find_eos_token_id(self, path: Path) -> int | None:
        """generation_config.json wins over config.json, which wins over tokenizer_config's eos_token."""
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            if isinstance(value, list) and value:
                return int(value[0])
            if isinstance(value, int):
                return value
        token = self.special_tokens["eos_token"]
        return self.tokenizer.token_to_id(token) if token else None

    def render(self, prompt: Prompt) -> str:
        """The prompt text: chat messages through the template with add_generation_prompt=True, else as is."""
        if not prompt.messages:
            return prompt.prompt
        if self.chat_template is None:
            raise InvalidArgument(f"prompt {prompt.index} of job {prompt.job_id} is a chat, but {self.path} has no "
                                  f"chat template (chat_template.jinja or tokenizer_config.json 'chat_template')")
        try:
            return self.chat_template.render(messages=prompt.messages, add_generation_prompt=True,
                                             **self.special_tokens)
        except jinja2.TemplateError as err:
            raise InvalidArgument(f"prompt {prompt.index} of job {prompt.job_id}: chat template failed: {err}") from err

    def render_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        add_generation_prompt: bool = True) -> str:
        """A conversation (with tool calls and the tools, for templates that render them) through the template;
        the agent gateway's turns. InvalidArgument when there is no template or it fails."""
        if self.chat_template is None:
            raise InvalidArgument(f"{self.path} has no chat template (chat_template.jinja or tokenizer_config.json "
                                  "'chat_template')")
        try:
            return self.chat_template.render(messages=messages, tools=tools or None,
                                             add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as err:
            raise InvalidArgument(f"chat template failed: {err}") from err

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, prompt: Prompt) -> tuple[str, list[int]]:
        """The rendered prompt and its tokens; a prompt's images each take as many image tokens as the model reads
        for it (image_tokens.py)."""
        text = self.render(prompt)
        ids = self.encode_text(text)
        if not prompt.images:
            return text, ids
        where = f"prompt {prompt.index} of job {prompt.job_id}"
        if self.image_tokens is None:
            raise InvalidArgument(f"{where} has {len(prompt.images)} images, but {self.path} is a text model")
        return text, self.image_tokens.expand(ids, prompt.images, where)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def model_context_len(path: Path) -> int | None:
    """The model's context in tokens (config.json's max_position_embeddings, or its text_config's), if named."""
    config = _read_json(path / "config.json")
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _compile(template: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)
