"""Build a tiny vision-language model on the spot (Qwen2.5-VL or Qwen3-VL, nothing from a hub): the demo's
character-level tokenizer with Qwen-VL's image tokens added, a randomly initialised model with a small vision tower,
and Qwen2-VL's image processor, saved as one Hugging Face directory the engines and the trainer read.
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
MERGE_SIZE = 2
PATCH_SIZES = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_5": 16, "qwen3_5_moe": 16}  # a vision patch's side, pixels
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # image-text-to-text families without a causal LM (both backends)
# Qwen3.5, dense and MoE: natively multimodal, with a causal LM too (gated delta-net layers): a job with images
# trains it whole
QWEN3_5_VLMS = ("qwen3_5", "qwen3_5_moe")


def build_tiny_vlm(out_dir: Path, corpus: list[str], *, family: str = "qwen2_5_vl", num_layers: int = 2,
                   hidden_size: int = 64, seed: int = 0) -> Path:
    """Tokenizer, image processor and model of `family` (qwen2_5_vl, qwen3_vl, qwen3_5 or qwen3_5_moe) in one HF
    directory; returns it.
    Skips the work when it is there. The processor resizes every image to between 4 and 16 merged patches."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    if family not in PATCH_SIZES:
        raise ValueError(f"vision-language family {family!r} is not one of {', '.join(PATCH_SIZES)}")
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
    patch = PATCH_SIZES[family]
    config = _config(family, vocab_size=len(tokenizer), eos=eos, ids=ids, hidden_size=hidden_size,
                     num_layers=num_layers, patch=patch)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out_dir, safe_serialization=True)
    side = patch * MERGE_SIZE  # one merged patch
    processor = Qwen2VLImageProcessorPil(min_pixels=(2 * side) ** 2, max_pixels=(4 * side) ** 2, patch_size=patch,
                                         merge_size=MERGE_SIZE, temporal_patch_size=2)
    processor.save_pretrained(out_dir)
    return out_dir


def _config(family: str, *, vocab_size: int, eos: int, ids: dict[str, int], hidden_size: int, num_layers: int,
            patch: int):
    from transformers import Qwen2_5_VLConfig, Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLConfig

    heads = max(1, hidden_size // 16)
    text = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_dim": hidden_size // heads, "max_position_embeddings": 1024, "eos_token_id": eos,
            "pad_token_id": eos, "bos_token_id": None,
            "rope_scaling": {"type": "mrope", "mrope_section": _mrope_section(hidden_size // heads)}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden_size,
              "patch_size": patch, "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": 2}
    tokens = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    if family == "qwen2_5_vl":
        vision.update(window_size=2 * patch * MERGE_SIZE, fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens, eos_token_id=eos, pad_token_id=eos,
                                bos_token_id=None)
    if family in QWEN3_5_VLMS:  # gated delta-net layers and one full-attention layer; half of each head rotates
        text.pop("rope_scaling")
        head_dim = hidden_size // heads
        text.update(layer_types=["linear_attention", "full_attention"][-num_layers:] if num_layers <= 2 else
                    ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
                    linear_conv_kernel_dim=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                    linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": _mrope_section(head_dim // 2), "mrope_interleaved": True})
        vision.update(num_position_embeddings=64)
        if family == "qwen3_5_moe":  # 4 experts, 2 per token, and a shared expert
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                        shared_expert_intermediate_size=hidden_size)
            return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=False)
        return Qwen3_5Config(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=False)
    text.pop("rope_scaling")  # Qwen3-VL: interleaved multimodal rotary positions over the default rope
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": _mrope_section(hidden_size // heads), "mrope_interleaved": True}
    vision.update(num_position_embeddings=64, deepstack_visual_indexes=[1])
    return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen-VL splits each head's rotary half (head_dim / 2) over time, height and width."""
    half = head_dim // 2
    return [half - 2 * (half // 3), half // 3, half // 3]
