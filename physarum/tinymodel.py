"""Build a tiny model (Qwen3 by default, or another family of `families.py`) and a character-level tokenizer on the
spot (nothing from a hub).

The tokenizer is trained on the task's own text; the model is randomly initialised from a config.
Both are saved as a Hugging Face directory that the engines, the trainer and the router all read.
"""

from __future__ import annotations

import json
from pathlib import Path

from physarum.families import DEFAULT_FAMILY, tiny_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
EOS_TOKEN = "<|endoftext|>"
# Qwen's chat format, rendered by the rollout manager for chat prompts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: list[str], out_dir: Path) -> None:
    """Train a character-level WordLevel tokenizer on `corpus` and save it as tokenizer.json + config."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path, *, num_layers: int = 2, hidden_size: int = 128, seed: int = 0,
                family: str = DEFAULT_FAMILY) -> None:
    """Save a randomly initialised causal LM of `family` sized for `out_dir`'s tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = tiny_config(family, vocab_size=len(vocab), eos_id=vocab[EOS_TOKEN], hidden_size=hidden_size,
                         num_layers=num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_model(out_dir: Path, corpus: list[str], *, num_layers: int = 2, hidden_size: int = 128,
                     seed: int = 0, family: str = DEFAULT_FAMILY) -> Path:
    """Tokenizer + model in one HF directory; returns it. Skips the work when it is already there."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(corpus, out_dir)
    build_model(out_dir, num_layers=num_layers, hidden_size=hidden_size, seed=seed, family=family)
    return out_dir
