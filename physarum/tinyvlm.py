"""Build a tiny vision-language model on the spot (Qwen2.5-VL, nothing from a hub): the demo's character-level
tokenizer with Qwen-VL's image tokens added, a randomly initialised model with a small vision tower, and Qwen2-VL's
image processor, saved as one Hugging Face directory the engines and the trainer read.
"""

from __future__ import annotations

from pathlib import Path

from physarum.tinymodel import EOS_TOKEN, build_tokenizer

# Qwen-VL's vision tokens: an image is <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|>
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's chat format with image parts, as its own template renders them
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56      # the image processor resizes every image into [MIN_PIXELS, MAX_PIXELS]
MAX_PIXELS = 112 * 112    # at most (112 / 14)^2 / 2^2 = 16 image tokens per image


def build_tiny_vlm(out_dir: Path, corpus: list[str], *, num_layers: int = 2, hidden_size: int = 64,
                   seed: int = 0) -> Path:
    """Tokenizer, image processor and model in one HF directory; returns it. Skips the work when it is there."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists() and (out_dir / "preprocessor_config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(corpus, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    heads = max(1, hidden_size // 16)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
                     "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": heads,
                     "max_position_embeddings": 1024, "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None,
                     "rope_scaling": {"type": "mrope", "mrope_section": _mrope_section(hidden_size // heads)}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": hidden_size, "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
                       "temporal_patch_size": 2, "window_size": 2 * PATCH_SIZE * MERGE_SIZE,
                       "fullatt_block_indexes": [1]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out_dir, safe_serialization=True)
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                         merge_size=MERGE_SIZE, temporal_patch_size=2)
    processor.save_pretrained(out_dir)
    return out_dir


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL splits each head's rotary half (head_dim / 2) over time, height and width."""
    half = head_dim // 2
    return [half - 2 * (half // 3), half // 3, half // 3]
