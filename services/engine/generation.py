"""The CPU engine's generation: per-row sampling and a transformers causal LM behind the torch-free scheduler.

Left-padded prefill, KV-cached decode; scheduling, pause, abort and stopping live in scheduler.py. Knows nothing of
HTTP (protocol.py, server.py) or of weight transfer (weights.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import torch

from services.engine.lora import LoRAServing
from services.engine.routing import RoutedExperts
from services.engine.scheduler import (
    PAUSE_MODES,
    Request,
    SamplingParams,
    Scheduler,
    abort_reason,
    token_id_set,
)
from services.engine.vision import Vision

__all__ = ["PAUSE_MODES", "Engine", "Request", "SamplingParams", "abort_reason", "load_model", "sample_next",
           "sample_rows"]

log = logging.getLogger(__name__)


def sample_next(logits: torch.Tensor, request: Request, rng: torch.Generator,
                eos_ids: frozenset[int], never: torch.Tensor | None = None) -> tuple[int, float]:
    """The next token of `request` from its last-position logits [V], with log_softmax(logits / T) at that token.

    T is the request's temperature (1 when greedy at temperature 0), as SGLang reports it; top-k, top-p and min-p
    only restrict which token may be drawn (SGLang's torch sampler), as do `never`'s ids (a vision-language model's
    image placeholders, which stand for pixels: a response cannot carry an image).
    """
    p = request.params
    if request.generator is None and p.sampling_seed is not None:
        request.generator = torch.Generator().manual_seed(p.sampling_seed)
    logits = logits.clone()
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(torch.tensor(request.output_ids, dtype=torch.long), minlength=logits.numel())
        counts = counts[: logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.input_ids) | set(request.output_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if len(request.output_ids) < p.min_new_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        logits[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
    temperature = 1.0 if p.temperature < 1e-6 else p.temperature
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    drawable = logprobs if never is None else logprobs.index_fill(0, never, float("-inf"))
    if p.greedy:
        token = int(torch.argmax(drawable))
    else:
        probs_sorted, order = torch.sort(drawable.exp(), descending=True)
        cumulative = torch.cumsum(probs_sorted, dim=0)
        if p.top_k > 0:
            probs_sorted[p.top_k:] = 0.0
        probs_sorted[(cumulative - probs_sorted) > p.top_p] = 0.0
        if p.min_p > 0:
            probs_sorted[probs_sorted < probs_sorted[0] * p.min_p] = 0.0
        pick = torch.multinomial(probs_sorted, 1, generator=request.generator or rng)
        token = int(order[pick])
    return token, float(logprobs[token])


def plain(request: Request) -> bool:
    """Sampled from the batch's shared RNG with temperature alone (no penalties, token bans, top-k/p, min-p or
    per-request seed): such rows are drawn together, one batched op per step instead of a dozen per row."""
    p = request.params
    return (not (p.frequency_penalty or p.presence_penalty) and p.repetition_penalty == 1.0
            and len(request.output_ids) >= p.min_new_tokens and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0
            and p.sampling_seed is None and request.generator is None)


def sample_rows(logits: torch.Tensor, requests: list[Request], rng: torch.Generator,
                eos_ids: frozenset[int], never: torch.Tensor | None = None) -> list[tuple[int, float]]:
    """sample_next for each row of logits [B, V]; the plain rows in one batch (same distribution, same log-probs)."""
    out: list[tuple[int, float] | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if plain(r)]
    if rows:
        temperatures = torch.tensor([1.0 if requests[i].params.temperature < 1e-6 else requests[i].params.temperature
                                     for i in rows], dtype=logits.dtype, device=logits.device)
        picked = logits[rows]
        logprobs = torch.log_softmax(picked / temperatures[:, None], dim=-1)
        drawable = logprobs if never is None else logprobs.index_fill(1, never, float("-inf"))
        tokens = torch.multinomial(drawable.exp(), 1, generator=rng).squeeze(1)
        greedy = torch.tensor([requests[i].params.greedy for i in rows], device=logits.device)
        tokens = torch.where(greedy, drawable.argmax(dim=-1), tokens)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        for i, token, logprob in zip(rows, tokens.tolist(), chosen.tolist(), strict=True):
            out[i] = (token, logprob)
    for i, request in enumerate(requests):
        if out[i] is None:
            out[i] = sample_next(logits[i], request, rng, eos_ids, never)
    return out  # type: ignore[return-value]


def load_model(model_path: str, *, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) from a Hugging Face directory: on `device` in `dtype`, eval mode, no gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # a vision-language checkpoint with its vision tower, as the trainer builds it for a job with images: one whose
    # family has no causal LM (Qwen2.5-VL, Qwen3-VL), or one whose family has both (Qwen3.5) when the directory
    # holds its image processor (else it is served as its language model)
    config = AutoConfig.from_pretrained(model_path)
    vision = getattr(config, "vision_config", None) is not None and (
        config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or (Path(model_path) / "preprocessor_config.json").is_file())
    model_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = model_class.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model, tokenizer


class Engine(Scheduler):
    """The scheduler over one transformers model: every batch is a real prefill and decode."""

    def __init__(self, model, tokenizer, *, max_batch_size: int = 64, seed: int = 0,
                 weight_version: str = "default", per_token_delay_s: float = 0.0, vision: Vision | None = None) -> None:
        text_config = model.config.get_text_config()
        eos_ids = frozenset(token_id_set(text_config.eos_token_id)
                            | token_id_set(getattr(model.generation_config, "eos_token_id", None)))
        context_len = getattr(text_config, "max_position_embeddings", None) or tokenizer.model_max_length
        super().__init__(vocab_size=text_config.vocab_size, context_len=context_len, eos_ids=eos_ids,
                         max_batch_size=max_batch_size, weight_version=weight_version,
                         per_token_delay_s=per_token_delay_s)
        self.model = model
        self.routing = RoutedExperts(model)
        self.routes_experts = self.routing.available
        self.tokenizer = tokenizer
        pad = text_config.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)
        self.tokenizer_lock = threading.Lock()  # a fast tokenizer used from two threads can fail "Already borrowed"
        self.rng = torch.Generator().manual_seed(seed)
        self.vision = vision
        self.never_drawn = None if vision is None else torch.tensor(vision.placeholder_ids, dtype=torch.long)
        self.lora: LoRAServing | None = None  # set by `serve_adapters`

    def serve_adapters(self, lora: LoRAServing) -> None:
        """Serve LoRA adapters: each request's lora_name picks its adapter (at most max_loras_per_batch a batch)."""
        self.lora = lora
        self.max_loras_per_batch = lora.max_loras_per_batch

    def _weight_version_of(self, request: Request) -> str:
        if request.lora_name is not None and self.lora is not None:
            adapter = self.lora.adapters.get(request.lora_name)
            if adapter is not None:
                return adapter.weight_version
        return self.weight_version

    def _adapters(self, batch: list[Request]):
        """The forward over `batch`'s rows with each row's adapter (nothing without LoRA serving)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.batch([r.lora_name for r in batch], self.model.device)

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return list(self.tokenizer(text)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @torch.no_grad()
    def _run_batch(self, batch: list[Request]) -> None:
        """Prefill the batch, then decode; requests that arrive meanwhile join at a step boundary (`_admit`), and the
        rows still running are prefilled again with them (their prompt and what they generated so far)."""
        while self._decode(batch):
            batch = list(self.running)  # the rows still running, then the ones that joined (set by `_admit`)

    @torch.no_grad()
    def _score_inputs(self, requests: list[Request]) -> None:
        """One forward per request over its whole input (a long input's logits [L, V] are never batched):
        log_softmax(logits / T) at each next input token, T as in `sample_next`."""
        for request in requests:
            ids = torch.tensor([request.input_ids], dtype=torch.long, device=self.model.device)
            extra = self._vision_inputs([request], ids, torch.ones_like(ids))
            with self._adapters([request]):
                logits = self.model(input_ids=ids, use_cache=False, **extra).logits[0, :-1].float().cpu()
            temperature = 1.0 if request.params.temperature < 1e-6 else request.params.temperature
            targets = torch.tensor(request.input_ids[1:], dtype=torch.long, device="cpu")
            scored = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
            request.input_logprobs = ([None, *scored.tolist()])[request.logprob_start_len:]

    def _worth_joining(self, active: list[Request], joining: list[Request]) -> bool:
        """Joining costs a new prefill of the rows still running, so requests join only while that is no more than
        twice their own prompt tokens: a burst of arrivals joins the batch its first request started, one late
        request does not re-read a long batch's context."""
        running_tokens = sum(len(r.input_ids) + len(r.output_ids) for r in active)
        return running_tokens <= 2 * sum(len(r.input_ids) for r in joining)

    def _prefill(self, batch: list[Request]):
        from transformers import DynamicCache

        contexts = [r.input_ids + r.output_ids for r in batch]
        size, width = len(batch), max(map(len, contexts))
        device = self.model.device  # the batch is padded on the host, then moved; sampling stays on the host
        input_ids = torch.full((size, width), self.pad_id, dtype=torch.long, device="cpu")
        mask = torch.zeros((size, width), dtype=torch.long, device="cpu")
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context):] = torch.tensor(context, dtype=torch.long, device="cpu")
            mask[row, width - len(context):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        extra = self._vision_inputs(batch, input_ids, mask)
        positions = extra.pop("position_ids") if extra else (mask.cumsum(-1) - 1).clamp(min=0)
        with self.routing.capture(any(r.return_routed_experts for r in batch)) as captured, self._adapters(batch):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             past_key_values=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1,
                             **extra)
        if captured:  # each row's context is right-aligned: its experts are the row's last len(context) positions
            experts = captured[0].view(size, width, self.routing.num_layers, self.routing.top_k)
            for row, (request, context) in enumerate(zip(batch, contexts, strict=True)):
                if request.return_routed_experts:
                    request.routed_experts = bytearray(experts[row, width - len(context):].numpy().tobytes())
        return out, mask, positions

    def _vision_inputs(self, batch: list[Request], input_ids: torch.Tensor, mask: torch.Tensor) -> dict:
        """A batch with images: their patches, grids and the multimodal rotary positions of every row (left padding
        masked); {} for a batch without images, which runs as a text model's."""
        rows = [r.images for r in batch if r.images is not None]
        if not rows:
            return {}
        device = self.model.device
        grid = torch.cat([images.image_grid_thw for images in rows]).to(device)
        positions, _ = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=self.vision.mm_token_type_ids(input_ids), image_grid_thw=grid,
            attention_mask=mask)
        pixel_values = torch.cat([images.pixel_values for images in rows]).to(device, self.model.dtype)
        return {"pixel_values": pixel_values, "image_grid_thw": grid, "position_ids": positions}

    def _decode(self, batch: list[Request]) -> bool:
        """Generate for `batch` until every row finished (False) or requests joined it (True: prefill again)."""
        size, device = len(batch), self.model.device
        out, mask, positions = self._prefill(batch)
        while True:
            logits = out.logits[:, -1, :].float().cpu()
            next_ids = torch.full((size, 1), self.pad_id, dtype=torch.long, device="cpu")
            done = []
            active = [row for row, request in enumerate(batch) if not request.finished]
            drawn = sample_rows(logits[active], [batch[row] for row in active], self.rng, self.eos_ids,
                                self.never_drawn)
            for row, (token, logprob) in zip(active, drawn, strict=True):
                request = batch[row]
                request.output_ids.append(token)
                request.output_logprobs.append(logprob)
                next_ids[row, 0] = token
                reason = self._finish_reason(request)
                if reason is not None:
                    done.append((request, reason))
            if not self._step_boundary(batch, done):
                return False
            if self._admit(batch):
                return True
            mask = torch.cat([mask, mask.new_ones((size, 1))], dim=1)
            positions = positions[..., -1:] + 1  # [B, 1], or [3, B, 1] for a VLM's multimodal rotary positions
            with self.routing.capture(any(r.return_routed_experts for r in batch)) as captured, \
                    self._adapters(batch):
                out = self.model(input_ids=next_ids.to(device), attention_mask=mask, position_ids=positions,
                                 past_key_values=out.past_key_values, use_cache=True)
            for row, request in enumerate(batch):  # a finished row's last token was fed for nothing: not recorded
                if captured and request.return_routed_experts and not request.finished:
                    request.routed_experts += captured[0][row].numpy().tobytes()
