"""slime.rollout.sglang_rollout: GenerateState (tokenizer, sampling params, concurrency of a job's generation) and
the default `generate`, for custom generate functions that build on them."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from services.rollout.generation.generate import generate as _physarum_generate
from services.rollout.generation.generate import sampling_params as _sampling_params
from services.rollout.generation.prompts import PromptEncoder


class Tokenizer:
    """The slice of a Hugging Face tokenizer plugins use, over the manager's torch-free tokenizer: call it for
    {"input_ids": [...]}, encode, decode, apply_chat_template, eos_token_id."""

    def __init__(self, model_path: str) -> None:
        self._encoder = PromptEncoder(model_path)
        self.eos_token_id = self._encoder.eos_token_id
        self.eos_token = self._encoder.special_tokens["eos_token"] or None
        self.pad_token = self._encoder.special_tokens["pad_token"] or None
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
def load_tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer(model_path)


class GenerateState:
    """One per job (slime keeps one per process, for its one job): args, tokenizer, the rollout's sampling params
    and a semaphore bounding the requests a plugin sends at once."""

    _states: dict[str, GenerateState] = {}

    def __new__(cls, args: Any) -> GenerateState:
        key = f"{getattr(args, 'job_id', '')}:{args.hf_checkpoint}"
        state = cls._states.get(key)
        if state is None:
            state = cls._states[key] = super().__new__(cls)
            state._init(args)
        return state

    def _init(self, args: Any) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = None  # multimodal processors are not supported
        concurrency = getattr(args, "sglang_server_concurrency", None) or 512
        self.semaphore = asyncio.Semaphore(concurrency)
        self.sampling_params = _sampling_params(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=list(getattr(args, "rollout_stop", None) or []),
            stop_token_ids=list(getattr(args, "rollout_stop_token_ids", None) or []))
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False


def get_model_url(args: Any, model_name: str = "", endpoint: str = "/generate") -> str:
    """The router's URL (Physarum serves one model per job)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's default generate: one /generate call continuing sample.tokens."""
    return await _physarum_generate(args, sample, sampling_params)


__all__ = ["GenerateState", "generate", "get_model_url", "load_tokenizer"]
