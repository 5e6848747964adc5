"""LoRA adapters for the engine tests: trainer states with non-zero adapters, the merged models they must equal, and a
CPU engine serving adapters (SGLang's --enable-lora flags)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from services.trainer.lora import export as lora_export
from services.trainer.lora import layers as lora_layers
from testkit.engines import start_engines, stop_engines

TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 5, 9, 6, 7]]
MAX_NEW_TOKENS = 6


def lora_state(tiny_model_dir, *, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's LoRA model's full state dict, its B made non-zero (a fresh adapter changes nothing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    lora_layers.add_adapters(model, rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=TARGETS)
    with torch.no_grad():
        for _, layer in lora_layers.lora_layers(model):
            layer.lora_B.weight.normal_(0.0, 0.3)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def merged_model(tiny_model_dir, state: dict[str, torch.Tensor] | None):
    """The base model with `state`'s adapters merged (export.merged_state_dict), or the base itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    if state is not None:
        scaling = 2.0  # alpha / rank
        merged = lora_export.merged_state_dict(state, scaling=scaling)
        model.load_state_dict(merged)
    return model


def adapter_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return sorted(lora_export.peft_state_dict(state).items())


def peft_config(rank: int) -> dict:
    return {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank, "target_modules": TARGETS}


@torch.no_grad()
def expected(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs (temperature 1, as the engine reports at temperature 0)."""
    ids = list(prompt)
    tokens, logprobs = [], []
    for _ in range(MAX_NEW_TOKENS):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def lora_engine(tiny_model_dir, work_dir: Path, *, max_loras: int, target_modules: str,
                weight_sync_timeout_s: float) -> Iterator[str]:
    """One CPU engine serving adapters of rank <= 8 (a module fixture yields from it): its URL, stopped after."""
    engines = start_engines(tiny_model_dir, work_dir, 1, "--enable-lora", "--max-loras-per-batch", str(max_loras),
                            "--max-lora-rank", "8", "--lora-target-modules", target_modules,
                            "--weight-sync-timeout-s", str(weight_sync_timeout_s))
    yield engines[0][1]
    stop_engines(engines)


def generate_rows(http: httpx.Client, lora_path) -> list[dict]:
    reply = http.post("/generate", json={"input_ids": PROMPTS, "lora_path": lora_path, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0,
                                                             "ignore_eos": True}})
    assert reply.status_code == 200, reply.text
    return reply.json()


def assert_rows_match(rows: list[dict], models: list) -> None:
    for prompt, row, model in zip(PROMPTS, rows, models, strict=True):
        tokens, logprobs = expected(model, prompt)
        assert row["output_ids"] == tokens
        got = [entry[0] for entry in row["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=1e-4)
