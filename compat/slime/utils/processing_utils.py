"""slime.utils.processing_utils: the tokenizer and processor of a job's model for plugins, the processor's keyword
arguments, the vision parts of chat messages, and images as the engines take them (data: URLs).

Both without torch: the tokenizer is the rollout service's (tokenizers, the chat template through jinja2); the
processor, a vision-language model's, gives the text's input_ids with each image placeholder expanded to that image's
tokens, as the engine expands them (services/rollout/generation/image_tokens.py). It computes no pixel values: the
trainer runs the model's image processor over each sample's images itself.
"""

from __future__ import annotations

import base64
import functools
import types
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument
from services.common.images import encoded_image
from services.rollout.generation.image_tokens import ImageTokens
from services.rollout.generation.prompts import PromptEncoder

DEFAULT_PATCH_SIZE = 14  # slime's, for a processor that does not say (Qwen2.5-VL's)


class Tokenizer:
    """The slice of a Hugging Face tokenizer plugins use, over the manager's torch-free tokenizer: call it for
    {"input_ids": [...]}, encode, decode, apply_chat_template, eos_token_id, bos_token_id."""

    def __init__(self, model_path: str) -> None:
        self._encoder = PromptEncoder(model_path)
        self.eos_token_id = self._encoder.eos_token_id
        self.eos_token = self._encoder.special_tokens["eos_token"] or None
        self.pad_token = self._encoder.special_tokens["pad_token"] or None
        self.bos_token = self._encoder.special_tokens["bos_token"] or None
        self.bos_token_id = self._encoder.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.chat_template = self._encoder.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encoder.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **_: Any) -> dict[str, Any]:
        if isinstance(text, list):
            return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return self._encoder.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, tools: list | None = None, **kwargs: Any) -> Any:
        if self.chat_template is None:
            raise ValueError(f"{self._encoder.path} has no chat template")
        text = self.chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **{**self._encoder.special_tokens, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.cache
def _tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer(model_path)


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Tokenizer:
    """The model's tokenizer (one per model directory)."""
    return _tokenizer(str(name_or_path))


class Processor:
    """A vision-language model's processor: `processor(text=..., images=...)` -> {"input_ids": [[...]],
    "attention_mask": [[...]]}, one row per text, as transformers' processors return them with text_kwargs'
    return_tensors None (slime's build_processor_kwargs)."""

    def __init__(self, model_path: str, image_tokens: ImageTokens) -> None:
        self.model_path = model_path
        self.image_tokens = image_tokens
        self.tokenizer = load_tokenizer(model_path)
        self.image_processor = types.SimpleNamespace(patch_size=image_tokens.patch_size,
                                                     merge_size=image_tokens.merge_size)

    def __call__(self, text: str | list[str] | None = None, images: list[Any] | None = None,
                 videos: list[Any] | None = None, **kwargs: Any) -> dict[str, list[list[int]]]:
        if videos:
            raise InvalidArgument("processor: videos; the engines and trainers here take images only")
        text_kwargs = dict(kwargs.pop("text_kwargs", None) or {})
        for name in ("images_kwargs", "videos_kwargs", "audio_kwargs"):  # their return_tensors: for pixel values
            kwargs.pop(name, None)
        if kwargs.get("return_tensors") is not None or text_kwargs.get("return_tensors") is not None:
            raise InvalidArgument("processor: return_tensors; this processor returns lists (it runs without torch)")
        texts = [text] if isinstance(text, str) else list(text or [])
        if not all(isinstance(t, str) for t in texts):
            raise InvalidArgument("processor: text must be a string or a list of strings (the prompt rendered with "
                                  "the chat template)")
        add_special_tokens = text_kwargs.get("add_special_tokens", kwargs.get("add_special_tokens", True))
        images = list(images or [])
        rows = []
        for i, one in enumerate(texts):
            ids = self.tokenizer.encode(one, add_special_tokens=add_special_tokens)
            placeholders = ids.count(self.image_tokens.image_token_id)
            mine, images = images[:placeholders], images[placeholders:]
            rows.append(self.image_tokens.expand(ids, mine, f"processor: text {i}"))
        if images:
            raise InvalidArgument(f"processor: {len(images)} images beyond the texts' image placeholders")
        return {"input_ids": rows, "attention_mask": [[1] * len(ids) for ids in rows]}

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


@functools.cache
def _processor(model_path: str) -> Processor | None:
    image_tokens = ImageTokens.load(Path(model_path))
    return None if image_tokens is None else Processor(model_path, image_tokens)


def load_processor(name_or_path: str, **kwargs: Any) -> Processor | None:
    """The model's processor, or None for a text model (as slime's, which discards a tokenizer given for one)."""
    return _processor(str(name_or_path))


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """slime's: the multimodal inputs, text_kwargs asking for lists (no tensors, no mm_token_type_ids) and each
    modality's kwargs for tensors."""
    result = dict(multimodal_inputs) if multimodal_inputs else {}
    result["text_kwargs"] = {**result.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        result[key] = {**result.get(key, {}), "return_tensors": "pt"}
    return result


def process_vision_info(prompt: list[dict[str, Any]], processor: Any) -> dict[str, Any]:
    """slime's: {"images", "videos"} of the messages' vision parts, resized for the processor's patch size."""
    from qwen_vl_utils import process_vision_info as qwen_process_vision_info

    patch_size = getattr(getattr(processor, "image_processor", None), "patch_size", None) or DEFAULT_PATCH_SIZE
    images, videos = qwen_process_vision_info(prompt, image_patch_size=patch_size)
    return {"images": images, "videos": videos}


def encode_image_for_rollout_engine(image: Any) -> str:
    """An image as the engines take it: a data: URL of a Pillow image as RGB PNG (slime's), of a prompt's image (a
    physarum Image, its bytes as read) unchanged."""
    image = encoded_image(image)
    return f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode()}"


__all__ = ["build_processor_kwargs", "encode_image_for_rollout_engine", "load_processor", "load_tokenizer",
           "process_vision_info"]
