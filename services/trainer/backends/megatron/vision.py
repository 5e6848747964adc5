"""A vision-language model on megatron-core, as slime's Qwen3.5 VLM path builds one: megatron's GPTModel as the
language model, transformers' own vision tower (`visual`, its HF weight names kept) beside it on the first pipeline
stage. The tower's outputs replace the image tokens' embeddings; Qwen3-VL's deepstack features are added to the
hidden states after its first layers; multimodal rotary positions (`position_ids` [3, b, s]) rotate the heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.common.errors import InvalidArgument
from services.trainer.models.arch import ModelArch


def load_vision_config(model_path: Path):
    """The checkpoint's transformers config (the whole vision-language one)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise InvalidArgument(f"model {model_path}: cannot read its vision-language config ({err})") from err


def build_vision_tower(hf_config, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' vision tower of `hf_config`'s family (the class its ...ForConditionalGeneration holds as
    model.visual), randomly initialised in `dtype` on the host; the backend loads its weights."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        whole = AutoModelForImageTextToText.from_config(hf_config)
    tower_class = type(whole.model.visual)
    tower = tower_class._from_config(hf_config.vision_config).to(dtype)
    for param in tower.parameters():  # whole on every tensor-parallel rank (megatron-core's marks)
        param.tensor_model_parallel = False
        param.partition_dim = -1
        param.partition_stride = 1
    return tower


def vision_gpt_class():
    """GPTModel with the vision tower in its first stage's embedding (imports megatron-core when called)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    class VisionGPTModel(GPTModel):
        """GPTModel(..., position_embedding_type="mrope", scatter_embedding_sequence_parallel=False) plus
        `visual` on the first stage; forward takes pixel_values [patches, D] and image_grid_thw [images, 3] of the
        rows' images in row order."""

        def attach_vision(self, hf_config, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
            self.image_token_id = int(hf_config.image_token_id)
            self.rotary_pos_emb = MultimodalRotary(arch, device)
            self.visual = build_vision_tower(hf_config, dtype).to(device) if self.pre_process else None
            self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # this forward's
            layers = getattr(getattr(self.visual, "config", None), "deepstack_visual_indexes", None) or []
            # Qwen3-VL: layer i's output gains deepstack feature i at the image tokens (the first stage's layers)
            for index in range(len(layers)):
                if index >= len(self.decoder.layers):
                    raise InvalidArgument(f"megatron backend: {arch.vision_model_type}'s deepstack features enter "
                                          f"its first {len(layers)} layers, which must be on the first pipeline "
                                          "stage")
                self.decoder.layers[index].register_forward_hook(self._deepstack_hook(index))

        def _deepstack_hook(self, index: int):
            def hook(_module, _args, output):
                if self._deepstack is None:
                    return output
                mask, features = self._deepstack
                hidden = output[0] if isinstance(output, tuple) else output
                added = hidden + self._scattered(mask, features[index].to(hidden.dtype), hidden)
                return (added, *output[1:]) if isinstance(output, tuple) else added
            return hook

        def _scattered(self, mask: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            """[s, b, H] zeros with `rows` at the image tokens (`mask` [b, s], in row order), this rank's sequence
            slice under sequence parallelism."""
            full = rows.new_zeros(*mask.shape, rows.shape[-1])
            full[mask] = rows
            full = full.transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                full = tensor_parallel.scatter_to_sequence_parallel_region(full)
            return full

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *, pixel_values=None,
                    image_grid_thw=None, image_mask=None, padding_mask=None, **kwargs):
            """image_mask [b, s]: the image tokens the images fill (the prompts'; default: every image token)."""
            self._deepstack = None
            if self.pre_process and decoder_input is None:
                embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, H], whole sequence
                if pixel_values is not None:
                    mask = input_ids == self.image_token_id if image_mask is None else image_mask
                    out = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
                    features = out.pooler_output
                    if int(mask.sum()) != features.shape[0]:
                        raise InvalidArgument(f"{int(mask.sum())} image tokens in the rows but {features.shape[0]} "
                                              "image features from their images")
                    merged = embeddings.transpose(0, 1).clone()
                    merged[mask] = features.to(merged.dtype)
                    embeddings = merged.transpose(0, 1).contiguous()
                    if getattr(out, "deepstack_features", None):
                        self._deepstack = (mask, list(out.deepstack_features))
                if self.config.sequence_parallel:
                    embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
                    if padding_mask is not None:  # GPTModel scatters it only when it embeds the tokens itself
                        padding_mask = tensor_parallel.scatter_to_sequence_parallel_region(
                            padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
                decoder_input = embeddings
            try:
                return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                       padding_mask=padding_mask, **kwargs)
            finally:
                self._deepstack = None

    return VisionGPTModel


class MultimodalRotary(torch.nn.Module):
    """Rotary angles [s, b, 1, rotary dim] from multimodal positions [3, b, s]: each head's rotary half split into
    time, height and width bands (mrope_section), one after another (Qwen2.5-VL) or interleaved (Qwen3-VL), each
    band turned by its own position. GPTModel calls it as `rotary_pos_emb(position_ids, mrope_section, cp_group=)`."""

    def __init__(self, arch: ModelArch, device: torch.device) -> None:
        super().__init__()
        dim = arch.rotary_dim  # Qwen3.5 turns a quarter of each head
        self.section = list(arch.mrope_section)
        self.interleaved = arch.mrope_interleaved
        self.register_buffer("inv_freq", 1.0 / (arch.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)), persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        # [3, b, s, dim/2]: each position's angles for each of the three axes
        freqs = position_ids.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq
        if self.interleaved:  # band i of each axis at dims i (mod 3) within its section (HF's interleaved mrope)
            mixed = freqs[0].clone()
            for axis in (1, 2):
                bands = slice(axis, self.section[axis] * 3, 3)
                mixed[..., bands] = freqs[axis, ..., bands]
        else:
            mixed = torch.cat([part[i] for i, part in enumerate(freqs.split(self.section, dim=-1))], dim=-1)
        emb = torch.cat([mixed, mixed], dim=-1)  # [b, s, dim]
        return emb.transpose(0, 1)[:, :, None, :].contiguous()
