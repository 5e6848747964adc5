"""Tiny models of every family the trainer and the CPU engine claim (2 layers, hidden 64), each sharing the demo's
character tokenizer, built once per test session from transformers' own config classes."""

from __future__ import annotations

import shutil
from pathlib import Path

from physarum import tinymodel
from services.trainer.checkpoint.hf_files import TOKENIZER_FILES

# qwen3, the default tiny model, is every other test's model
FAMILIES = ("llama", "glm4", "qwen3_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_5", "qwen3_5_moe")
TIED = {"qwen3", "qwen3_5"}  # tiny configs whose lm_head is the embedding


def build_family_model(root: Path, tokenizer_dir: Path, family: str) -> Path:
    out = root / f"family-{family}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    tinymodel.build_model(out, num_layers=2, hidden_size=64, family=family)
    return out
