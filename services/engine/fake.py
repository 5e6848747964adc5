"""Fake compute for control-plane tests and benchmarks (`--fake-compute`): no model and no torch, so many engines fit
on one machine. Each decode step gives every running request a random token with a uniform log-prob, after the
`--per-token-delay-s` wait; replies keep SGLang's exact shapes. Weights are only a version: update_weights_from_disk
reads the checkpoint files and sets it; the distributed weight protocol needs the real engine.
"""

from __future__ import annotations

import json
import math
import random
import struct
import threading
from pathlib import Path

from services.common.errors import FailedPrecondition, NotFound
from services.engine.scheduler import Request, Scheduler, token_id_set

NO_WEIGHTS = "this engine runs fake compute (--fake-compute) and holds no weights"


def read_model_config(model_path: str | Path) -> dict:
    """config.json of a HF model directory, its text_config for multimodal models."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("text_config") or config


class FakeEngine(Scheduler):
    """The scheduler with random tokens in place of a model; vocabulary, context and eos from config.json."""

    def __init__(self, model_path: str, *, per_token_delay_s: float = 0.0, max_batch_size: int = 64, seed: int = 0,
                 weight_version: str = "default") -> None:
        config = read_model_config(model_path)
        generation = Path(model_path) / "generation_config.json"
        eos_ids = token_id_set(config.get("eos_token_id"))
        if generation.is_file():
            eos_ids |= token_id_set(json.loads(generation.read_text()).get("eos_token_id"))
        super().__init__(vocab_size=int(config["vocab_size"]), context_len=int(config.get("max_position_embeddings")
                                                                                or 4096),
                         eos_ids=frozenset(eos_ids), max_batch_size=max_batch_size, weight_version=weight_version,
                         per_token_delay_s=per_token_delay_s)
        self.rng = random.Random(seed)
        self.tokenizer = None
        if (Path(model_path) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        self.tokenizer_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise FailedPrecondition("text prompts need tokenizer.json in the model directory; send input_ids")
        with self.tokenizer_lock:
            return list(self.tokenizer.encode(text).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        with self.tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _draw(self, request: Request) -> int:
        p = request.params
        if request.generator is None and p.sampling_seed is not None:
            request.generator = random.Random(p.sampling_seed)
        rng = request.generator or self.rng
        banned = (set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
                  if len(request.output_ids) < p.min_new_tokens else set())
        token = rng.randrange(self.vocab_size)
        while token in banned and len(banned) < self.vocab_size:
            token = rng.randrange(self.vocab_size)
        return token

    def _score_inputs(self, requests: list[Request]) -> None:
        """A uniform log-prob for every input token after the first, as the fake decode gives."""
        for request in requests:
            logprobs = [None] + [-math.log(self.vocab_size)] * (len(request.input_ids) - 1)
            request.input_logprobs = logprobs[request.logprob_start_len:]

    def _run_batch(self, batch: list[Request]) -> None:
        """Continuous batching, as SGLang does it: waiting requests join the running batch at every step."""
        logprob = -math.log(self.vocab_size)
        while True:
            if self._admit(batch):
                batch = self.running
            done = []
            for request in batch:
                if request.finished:
                    continue
                request.output_ids.append(self._draw(request))
                request.output_logprobs.append(logprob)
                reason = self._finish_reason(request)
                if reason is not None:
                    done.append((request, reason))
            if not self._step_boundary(batch, done):
                return


def safetensors_names(path: Path) -> list[str]:
    """Tensor names in a .safetensors file's header (8-byte little-endian length, then JSON), read without torch."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return [name for name in header if name != "__metadata__"]


class FakeWeights:
    """The weight-update side of a fake engine: a version that update_weights_from_disk sets after reading the files."""

    def __init__(self, engine: FakeEngine, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s

    def update_from_disk(self, model_path: str, weight_version: str | None = None,
                         abort_all_requests: bool = False) -> str:
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise NotFound(f"update_weights_from_disk: no *.safetensors file in {model_path!r}")
        names = [name for f in files for name in safetensors_names(f)]
        num_bytes = sum(len(f.read_bytes()) for f in files)  # the I/O a real load does
        if abort_all_requests:
            self.engine.abort(abort_all=True, message="Abort by update_weights_from_disk")
        with self.engine.exclusive(self.timeout_s):
            if weight_version is not None:
                self.engine.weight_version = str(weight_version)
        return f"Succeeded to update model weights from {model_path} ({len(names)} tensors, {num_bytes} bytes)."

    def begin(self, selector: str = "all") -> str:
        return "Weight update session started."

    def end(self) -> str:
        return "Weight update session ended."

    def _unsupported(self, **kwargs) -> str:
        raise FailedPrecondition(f"{NO_WEIGHTS}: the distributed weight protocol needs the real engine; "
                                 f"use update_weights_from_disk")

    init_group = destroy_group = update_from_distributed = _unsupported

    def get_weights(self, name: str, truncate_size: int = 100) -> list[float]:
        raise FailedPrecondition(f"{NO_WEIGHTS}: no parameter {name!r}")
