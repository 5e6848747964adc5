"""Tiny checkpoints with multi-token-prediction layers for the tests. A MiMo: a Qwen2 checkpoint with MTP layers under
MiMo's names (`model.mtp_layers.{i}.*`, config num_nextn_predict_layers; MiMo's own modeling code ships with its
checkpoints, so the model stays a qwen2 one that transformers loads, its MTP tensors left aside), and MiMo's MTP loss
computed by hand with plain torch over transformers' Qwen2 modules. A DeepSeek-V3 (or a GLM-4.5+) with its MTP layer
as one more decoder layer (`model.layers.{num_hidden_layers}.*` with enorm, hnorm, eh_proj, shared_head.norm). A
Qwen3-Next or Qwen3.5 with its MTP layer under `mtp.*` (config mtp_num_hidden_layers), its MTP loss computed by hand
over transformers' modules of the family as MiMo's is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

MTP_NORMS = ("token_layernorm", "hidden_layernorm", "final_layernorm")


def build_tiny_mimo(out_dir: Path, num_mtp_layers: int = 1, *, seed: int = 0, tied: bool = False,
                    num_layers: int = 2) -> Path:
    """A random `num_layers`-layer Qwen2 (vocab 300, which Megatron pads; its head untied unless `tied`; norms away
    from 1) with `num_mtp_layers` MTP layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, rope_theta=1e4, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return add_mtp_layers(out_dir, num_mtp_layers, seed=seed + 5)


def add_mtp_layers(model_dir: Path, num_layers: int = 1, *, seed: int = 5) -> Path:
    """Give the Qwen2 checkpoint in `model_dir` `num_layers` random MiMo MTP layers (norms away from 1, q/k/v
    biases away from 0, so a lost or swapped one shows)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    hf_config = Qwen2Config.from_pretrained(model_dir)
    hidden = hf_config.hidden_size
    weights = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for index in range(num_layers):
        prefix = f"model.mtp_layers.{index}."
        layer = Qwen2DecoderLayer(hf_config, layer_idx=0)
        for name, param in layer.state_dict().items():
            if "norm" in name:
                value = 0.5 + torch.rand(param.shape, generator=generator)
            elif name.endswith(".bias"):
                value = 0.2 * torch.randn(param.shape, generator=generator)
            else:
                value = 0.05 * torch.randn(param.shape, generator=generator)
            weights[prefix + name] = value.contiguous()
        for norm in MTP_NORMS:
            weights[f"{prefix}{norm}.weight"] = 0.5 + torch.rand(hidden, generator=generator)
        weights[prefix + "input_proj.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    config_path.write_text(json.dumps({**config, "num_nextn_predict_layers": num_layers}, indent=2))
    return model_dir


def mtp_losses(model_dir: Path, sequences: list[tuple[list[int], list[float]]],
               num_layers: int = 1) -> list[float]:
    """Each depth's MTP loss over `sequences` (tokens, the response's loss mask; the response ends the tokens), as
    MiMo, Qwen3-Next and Qwen3.5 compute it: at depth k the position t takes the previous depth's hidden state at t
    (the decoder's final norm output at depth 1) and the embedding of token t + k, each through its own norm, projected
    from their concatenation (MiMo's input_proj: hidden first; Qwen's mtp.fc: embedding first), one decoder layer
    (causal, RoPE at t; Qwen's a full-attention one), a final norm and the LM head, and predicts token t + k + 1: the
    cross-entropy averaged over the trained response tokens that some position predicts."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = load_file(model_dir / "model.safetensors")
    qwen_next = config.model_type != "qwen2"
    if qwen_next:  # names: (embedding norm, hidden norm, projection, final norm); one layer of the decoder's kind
        names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
        layer_index = config.layer_types.index("full_attention")
    else:
        names, layer_index = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"), 0
    sums, counts = [0.0] * num_layers, [0.0] * num_layers
    with torch.no_grad():
        for tokens, loss_mask in sequences:
            ids = torch.tensor([tokens])
            length, prompt_len = len(tokens), len(tokens) - len(loss_mask)
            hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
            positions = torch.arange(length)[None]
            rotary = model.model.rotary_emb(hidden, positions)
            causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
            for depth in range(1, num_layers + 1):
                prefix = "mtp.layers.0." if qwen_next else f"model.mtp_layers.{depth - 1}."
                own = "mtp." if qwen_next else prefix

                def norm(name: str, x: torch.Tensor, own: str = own) -> torch.Tensor:
                    layer_norm = type(model.model.norm)(config.hidden_size, eps=config.rms_norm_eps)
                    layer_norm.weight.copy_(weights[f"{own}{name}.weight"])
                    return layer_norm(x)

                shifted = torch.cat([ids[:, depth:], ids.new_zeros(1, depth)], dim=1)  # token t + depth
                embedded, normed = norm(names[0], model.model.embed_tokens(shifted)), norm(names[1], hidden)
                x = F.linear(torch.cat([embedded, normed] if qwen_next else [normed, embedded], -1),
                             weights[f"{own}{names[2]}.weight"])
                layer = type(model.model.layers[layer_index])(config, layer_idx=layer_index).eval()
                layer.load_state_dict({name.removeprefix(prefix): tensor for name, tensor in weights.items()
                                       if name.startswith(prefix) and name.removeprefix(prefix).split(".")[0]
                                       not in names})
                x = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
                x = x[0] if isinstance(x, tuple) else x
                hidden = norm(names[3], x)
                log_probs = torch.log_softmax(model.lm_head(hidden)[0], dim=-1)
                for j, weight in enumerate(loss_mask):
                    position = prompt_len + j - 1 - depth  # predicts token prompt_len + j
                    if weight and position >= 0:
                        sums[depth - 1] -= weight * float(log_probs[position, tokens[prompt_len + j]])
                        counts[depth - 1] += weight
    return [total / count for total, count in zip(sums, counts, strict=True)]


def build_tiny_qwen_next_with_mtp(out_dir: Path, family: str = "qwen3_next", *, seed: int = 0) -> Path:
    """A random tiny Qwen3-Next or Qwen3.5 (`physarum.families`' shape: a gated delta-net, then a full-attention layer)
    with its MTP layer as their checkpoints hold it: mtp.layers.0.* a full-attention layer (its last one's tensors,
    perturbed, under transformers' in-memory names), mtp.fc and mtp's three norms (zero-centered, as the decoder's:
    small values, so a norm taken as plain shows)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from physarum.families import tiny_config

    config = tiny_config(family, vocab_size=300, eos_id=1, hidden_size=64)
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    weights = load_file(out_dir / "model.safetensors")
    full = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in model.model.layers[full].state_dict().items():
        weights["mtp.layers.0." + name] = (tensor + 0.01 * torch.randn(tensor.shape, generator=generator)).contiguous()
    hidden = config.hidden_size
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = 0.5 * torch.rand(hidden, generator=generator) - 0.25
    weights["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "mtp_num_hidden_layers": 1}, indent=2))
    return out_dir


def build_tiny_deepseek_v3_with_mtp(out_dir: Path, *, seed: int = 0) -> Path:
    """A random tiny DeepSeek-V3 (`physarum.families`' shape: MLA, a dense first layer, then MoE) with one MTP layer
    (`add_deepseek_mtp_layer`)."""
    from transformers import AutoModelForCausalLM

    from physarum.families import tiny_config

    config = tiny_config("deepseek_v3", vocab_size=300, eos_id=1, hidden_size=64)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return add_deepseek_mtp_layer(out_dir, seed=seed + 1)


def add_deepseek_mtp_layer(model_dir: Path, *, seed: int = 1) -> Path:
    """Give the DeepSeek-V3 or GLM-4.5+ checkpoint in `model_dir` one MTP layer as DeepSeek names it: its last decoder
    layer's tensors, perturbed, as layer num_hidden_layers, and its own norms and projection."""
    from safetensors.torch import load_file, save_file

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    weights = load_file(model_dir / "model.safetensors")
    last, mtp = f"model.layers.{config['num_hidden_layers'] - 1}.", f"model.layers.{config['num_hidden_layers']}."
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    for name in [name for name in weights if name.startswith(last)]:
        tensor = weights[name]
        weights[mtp + name.removeprefix(last)] = tensor + 0.01 * torch.randn(tensor.shape, generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{mtp}{norm}.weight"] = 0.5 + torch.rand(hidden, generator=generator)
    weights[mtp + "eh_proj.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    config_path.write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return model_dir
