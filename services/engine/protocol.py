"""SGLang's /generate wire format (GenerateReqInput fields, meta_info replies): request bodies to Requests, and back.

Validation errors are InvalidArgument naming the field; the server answers them with HTTP 400.
"""

from __future__ import annotations

import base64
import math
import uuid
from dataclasses import dataclass, fields

from services.common.errors import InvalidArgument
from services.engine.scheduler import Request, SamplingParams, Scheduler

# The keys SGLang's SamplingParams accepts; any other key is rejected with 400, as SGLang does.
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"})
# Accepted by SGLang but not implemented here: allowed only when unset.
UNSUPPORTED_KEYS = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "beam_width",
                    "watermark", "choice")
MAX_N = 128                   # samples of one prompt in one call
MAX_REQUESTS_PER_CALL = 4096  # prompts × n of one call: each is decoded, so a client cannot queue unbounded work
_NUMBERS = {f.name: f.type for f in fields(SamplingParams)
            if f.type in ("int", "float", "int | None")}


@dataclass
class GenerateCall:
    """The requests of one /generate body, in response order (prompt-major, then sample), and the reply shape."""

    requests: list[Request]
    return_logprob: list[bool]
    listed: bool  # reply with a list (a batch, or n > 1) rather than one object


def _number(key: str, value, kind: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"sampling_params.{key} must be a finite number, got {value!r}")
    if kind.startswith("int"):
        if value != int(value):
            raise InvalidArgument(f"sampling_params.{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def parse_sampling_params(raw) -> tuple[SamplingParams, int]:
    """(SamplingParams, n) from one `sampling_params` object; null values mean the default."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - SAMPLING_KEYS)
    if unknown:
        raise InvalidArgument(f"sampling_params: unknown keys {', '.join(unknown)} "
                              f"(allowed: {', '.join(sorted(SAMPLING_KEYS))})")
    unsupported = [k for k in UNSUPPORTED_KEYS if raw.get(k) not in (None, {}, [], 0, False)]
    if unsupported:
        raise InvalidArgument(f"sampling_params: {', '.join(unsupported)} not supported by the CPU engine")
    values = {k: v for k, v in raw.items() if v is not None}
    kwargs: dict = {}
    for key, kind in _NUMBERS.items():
        if key in values:
            kwargs[key] = _number(key, values[key], kind)
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if key in values:
            if not isinstance(values[key], bool):
                raise InvalidArgument(f"sampling_params.{key} must be true or false, got {values[key]!r}")
            kwargs[key] = values[key]
    stop = values.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
    kwargs["stop"] = tuple(stop)
    stop_ids = values.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise InvalidArgument(f"sampling_params.stop_token_ids must be a list of integers, got {stop_ids!r}")
    kwargs["stop_token_ids"] = frozenset(stop_ids)
    n = _number("n", values.get("n", 1), "int")
    params = SamplingParams(**kwargs)
    _check_ranges(params, n)
    return params, n


def _check_ranges(p: SamplingParams, n: int) -> None:
    """SGLang's SamplingParams.verify, as messages that name the parameter."""
    checks = [
        (p.temperature >= 0, f"temperature must be non-negative, got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (disable), or at least 1, got {p.top_k}"),
        (-2 <= p.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (-2 <= p.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (0 < p.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}"),
        (p.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {p.max_new_tokens}"),
        (0 <= p.min_new_tokens <= p.max_new_tokens,
         f"min_new_tokens must be in [0, max_new_tokens={p.max_new_tokens}], got {p.min_new_tokens}"),
        (1 <= n <= MAX_N, f"n must be in [1, {MAX_N}], got {n}"),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidArgument(f"sampling_params: {message}")


def _per_prompt(body: dict, key: str, size: int, default):
    """A field that is one value for every prompt or a list with one value per prompt."""
    value = body.get(key, default)
    if isinstance(value, list):
        if len(value) != size:
            raise InvalidArgument(f"{key}: a list of {len(value)} values for {size} prompts")
        return value
    return [default if value is None else value] * size


def _prompts(body: dict, engine: Scheduler) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise InvalidArgument("input_embeds is not supported by the CPU engine; send input_ids or text")
    if body.get("image_data") not in (None, [], "") and engine.vision is None:  # without them: another prompt
        raise InvalidArgument("image_data: the engine's model is a text model and takes no images")
    if (text is None) == (input_ids is None):
        raise InvalidArgument("exactly one of text and input_ids is required")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise InvalidArgument("input_ids must be a list of token ids or a list of such lists")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        for i, prompt in enumerate(prompts):
            where = f"input_ids[{i}]" if batched else "input_ids"
            if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
                raise InvalidArgument(f"{where} must be a list of integers")
            bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
            if bad:
                raise InvalidArgument(f"{where}: token id {bad[0]} out of range [0, {engine.vocab_size})")
        return prompts, batched
    batched = isinstance(text, list)
    texts = text if batched else [text]
    if not all(isinstance(t, str) for t in texts):
        raise InvalidArgument("text must be a string or a list of strings")
    return [engine.encode(t) for t in texts], batched


def parse_generate(body: dict, engine: Scheduler) -> GenerateCall:
    """The Requests of a /generate body, checked against the engine's vocabulary and context length."""
    prompts, batched = _prompts(body, engine)
    if not prompts:
        raise InvalidArgument("empty batch: no prompt given")
    size = len(prompts)
    sampling = _per_prompt(body, "sampling_params", size, {})
    logprob_flags = _per_prompt(body, "return_logprob", size, False)
    routed_flags = _per_prompt(body, "return_routed_experts", size, False)
    if any(routed_flags) and not engine.routes_experts:
        raise InvalidArgument("return_routed_experts: the engine's model has no MoE router whose experts it reports "
                              "(Qwen3-MoE, Qwen3.5-MoE, GLM-4-MoE, DeepSeek-V3)")
    start_lens = _per_prompt(body, "logprob_start_len", size, -1)
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in range(size)]
    elif isinstance(rids, str) and not batched:
        rids = [rids]
    if not isinstance(rids, list) or len(rids) != size or not all(isinstance(r, str) for r in rids):
        raise InvalidArgument(f"rid must be a string for one prompt or a list of {size} strings, got {rids!r}")
    images = _per_prompt_images(body.get("image_data"), size, batched)
    lora_names = _lora_names(body, size, engine)
    requests, return_logprob, listed = [], [], batched
    for i, prompt in enumerate(prompts):
        where = f"prompt {i}" if batched else "prompt"
        if not prompt:
            raise InvalidArgument(f"{where} is empty")
        prompt_images = None
        if images[i]:
            prompt_images = engine.vision.process(images[i], where)
            prompt = engine.vision.expand(prompt, prompt_images, where)
        if len(prompt) >= engine.context_len:
            raise InvalidArgument(f"{where}: the input ({len(prompt)} tokens) is longer than the model's context "
                                  f"length ({engine.context_len} tokens)")
        params, n = parse_sampling_params(sampling[i])
        if params.max_new_tokens > engine.context_len:
            raise InvalidArgument(f"{where}: max_new_tokens {params.max_new_tokens} is more than the model's context "
                                  f"length ({engine.context_len} tokens)")
        if len(requests) + n > MAX_REQUESTS_PER_CALL:
            raise InvalidArgument(f"more than {MAX_REQUESTS_PER_CALL} requests (prompts × n) in one call")
        listed = listed or n > 1
        start = _logprob_start_len(start_lens[i], len(prompt), where) if logprob_flags[i] else -1
        for j in range(n):
            requests.append(Request(rid=rids[i] if n == 1 else f"{rids[i]}_{j}", input_ids=list(prompt),
                                    params=params, return_routed_experts=bool(routed_flags[i]),
                                    logprob_start_len=start, images=prompt_images, lora_name=lora_names[i]))
            return_logprob.append(bool(logprob_flags[i]))
    return GenerateCall(requests, return_logprob, listed)


def _per_prompt_images(image_data, size: int, batched: bool) -> list[list]:
    """SGLang's image_data as one list of images per prompt: for one prompt an image or a list of them, for a
    batch a list with one entry (None, an image or a list of images) per prompt."""
    if image_data in (None, [], ""):
        return [[] for _ in range(size)]
    if not batched:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != size:
        raise InvalidArgument(f"image_data: a batch of {size} prompts needs a list of {size} entries, one per prompt")
    return [[] if item is None else item if isinstance(item, list) else [item] for item in image_data]


def _lora_names(body: dict, size: int, engine: Scheduler) -> list[str | None]:
    """SGLang's lora_path: one adapter name (or null: the base model) for every prompt, or a list with one each."""
    names = _per_prompt(body, "lora_path", size, None)
    if all(name is None for name in names):
        return names
    lora = getattr(engine, "lora", None)
    if lora is None:
        raise InvalidArgument("lora_path: the engine serves no LoRA adapters (start it with --enable-lora)")
    for i, name in enumerate(names):
        if name is not None and not isinstance(name, str):
            raise InvalidArgument(f"lora_path: an adapter name or null per prompt, got {name!r}")
        if name is not None:
            lora.check_name(name, f"prompt {i}" if size > 1 else "prompt")
    return names


def _logprob_start_len(value, prompt_len: int, where: str) -> int:
    """SGLang's logprob_start_len: -1 (no input log-probs) or the first input position to score."""
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < prompt_len:
        raise InvalidArgument(f"{where}: logprob_start_len must be an integer in [-1, {prompt_len - 1}] (the input "
                              f"has {prompt_len} tokens), got {value!r}")
    return value


def to_response(request: Request, return_logprob: bool, index: int | None) -> dict:
    """One finished request as SGLang's /generate object (§3.2)."""
    response = to_chunk(request, return_logprob, index, len(request.output_ids), request.text or "")
    response["meta_info"].update(finish_reason=request.finish_reason, weight_version=request.weight_version,
                                 e2e_latency=request.finished_s - request.created_s)
    return response


def to_chunk(request: Request, return_logprob: bool, index: int | None, num_tokens: int, text: str) -> dict:
    """A streamed request's first `num_tokens` tokens as SGLang's cumulative stream chunk (§3.3): the text and ids so
    far, finish_reason null."""
    ids = request.output_ids[:num_tokens]
    meta = {"id": request.rid, "finish_reason": None, "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(ids), "cached_tokens": request.cached_tokens,
            "weight_version": request.weight_version}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None]
                                         for lp, tok in zip(request.output_logprobs[:num_tokens], ids, strict=True)]
        if request.input_logprobs is not None:  # SGLang's shape: the first input token's log-prob is null
            scored = request.input_ids[request.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, tok, None]
                                            for lp, tok in zip(request.input_logprobs, scored, strict=True)]
    if request.return_routed_experts:  # SGLang's layout: base64 of int32 [len(tokens) - 1, num_layers, top_k]
        meta["routed_experts"] = base64.b64encode(bytes(request.routed_experts)).decode("ascii")
    response = {"text": text, "output_ids": ids, "meta_info": meta}
    if index is not None:
        response["index"] = index
    return response
