"""Build a tiny Qwen3-architecture model and a character-level tokenizer on the spot (nothing from a hub).

The tokenizer is trained on the task's own text; the model is randomly initialised from a config.
Both are saved as a Hugging Face directory that the engines, the trainer and the router all read.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def build_model(out_dir: Path, *, num_layers: int = 2, hidden_size: int = 128, seed: int = 0) -> None:
    """Save a randomly initialised Qwen3ForCausalLM sized for `out_dir`'s tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    eos_id = vocab[EOS_TOKEN]
    config = Qwen3Config(
        vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_model(out_dir: Path, corpus: list[str], *, num_layers: int = 2, hidden_size: int = 128,
                     seed: int = 0) -> Path:
    """Tokenizer + model in one HF directory; returns it. Skips the work when it is already there."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(corpus, out_dir)
    build_model(out_dir, num_layers=num_layers, hidden_size=hidden_size, seed=seed)
    return out_dir
