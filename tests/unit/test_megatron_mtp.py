"""Multi-token prediction's pieces without processes: MiMo's and DeepSeek-V3's MTP weights through the HF <->
Megatron conversion and back at TP 2 (MiMo's input_proj halves swapped into eh_proj's order), the depths cut from the
model's output (under sequence parallelism too), the response token each depth's position predicts, and the job
checks at submit."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.api.preflight import preflight
from services.trainer.api.spec import parse_spec
from services.trainer.backends.megatron import mtp as megatron_mtp
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.checkpoint.megatron_convert import hf_to_megatron, megatron_to_hf
from services.trainer.models import mtp
from services.trainer.models.arch import ModelArch

QWEN2 = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
LAYER = {"input_layernorm.weight": (8,), "post_attention_layernorm.weight": (8,), "self_attn.q_proj.weight": (8, 8),
         "self_attn.k_proj.weight": (4, 8), "self_attn.v_proj.weight": (4, 8), "self_attn.o_proj.weight": (8, 8),
         "self_attn.q_proj.bias": (8,), "self_attn.k_proj.bias": (4,), "self_attn.v_proj.bias": (4,),
         "mlp.gate_proj.weight": (12, 8), "mlp.up_proj.weight": (12, 8), "mlp.down_proj.weight": (8, 12)}


def random_checkpoint(arch: ModelArch, mtp_prefix: str, mtp_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every HF tensor of a tiny Qwen2-shaped model with one MTP layer under `mtp_prefix`, random."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (300, 8), "model.norm.weight": (8,), "lm_head.weight": (300, 8),
              **{f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in LAYER.items()},
              **{mtp_prefix + name: shape for name, shape in LAYER.items()},
              **{mtp_prefix + hf: ((8, 16) if mg == "eh_proj.weight" else (8,)) for mg, hf in mtp_names.items()}}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


@pytest.mark.parametrize("model_type, prefix", [("qwen2", "model.mtp_layers.0."), ("mimo", "model.mtp_layers.0."),
                                                ("deepseek_style_qwen2", "model.layers.2.")])
def test_mtp_weights_convert_to_megatron_and_back_at_tp2(model_type, prefix):
    arch = ModelArch.from_hf_config({**QWEN2, "model_type": "mimo" if model_type == "mimo" else "qwen2"})
    arch = ModelArch(**{**arch.__dict__, "mtp_num_layers": 1})
    names = mtp.hf_names(arch.model_type)
    if model_type == "deepseek_style_qwen2":  # the same layer under DeepSeek-V3's names
        arch = ModelArch(**{**arch.__dict__, "model_type": "glm4_moe"})
        names = mtp.DEEPSEEK_NAMES
    hf = random_checkpoint(arch, prefix, names)
    shards = [hf_to_megatron(hf, arch, tp_rank=rank, tp_size=2) for rank in range(2)]
    mg = {name for name in shards[0] if name.startswith("mtp.")}
    assert mg == {"mtp.layers.0." + sub for sub in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                     "final_layernorm.weight")} | {
        name for name in mg if name.startswith("mtp.layers.0.transformer_layer.")}
    assert len(mg) == 4 + 7  # norms and projection; the layer's 2 norms, qkv (and bias), proj, fc1, fc2
    eh_proj = torch.cat([shards[0]["mtp.layers.0.eh_proj.weight"], shards[1]["mtp.layers.0.eh_proj.weight"]])
    hidden_first = hf[prefix + names["eh_proj.weight"]]
    if mtp.swaps_projection_halves(arch.model_type):  # MiMo: cat(hidden, token); megatron-core: cat(embedding, hidden)
        assert torch.equal(eh_proj, torch.cat([hidden_first[:, 8:], hidden_first[:, :8]], dim=1))
    else:
        assert torch.equal(eh_proj, hidden_first)
    back = dict(pair for name in sorted(mg) for pair in megatron_to_hf(name, [s[name] for s in shards], arch))
    assert back.keys() == {name for name in hf if name.startswith(prefix)}
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name


def test_depths_come_apart_in_order_also_under_sequence_parallelism():
    depth_values = torch.arange(2 * 3 * 4).view(1, 3, 8)  # [b, depths, s]
    assert [d.tolist() for d in megatron_mtp.split_depths(depth_values.view(1, 24), 2)] == \
        depth_values[0, :, None].tolist()
    # 2 TP ranks each gathered their halves of all three depths: [rank, depth, s/2]
    gathered = depth_values.view(1, 3, 2, 4).transpose(1, 2).reshape(1, 24)
    assert [d.tolist() for d in megatron_mtp.split_depths(gathered, 2, sequence_parallel_size=2)] == \
        depth_values[0, :, None].tolist()


@pytest.mark.parametrize("packed", [True, False])
def test_each_depth_predicts_the_response_token_from_depth_positions_earlier(packed):
    samples = [Sample(tokens=[5, 6, 7, 8, 9], response_length=3, reward=0.0, loss_mask=[1, 0, 1]),
               Sample(tokens=[1, 2, 3], response_length=2, reward=0.0)]
    mb = build_rollout_batch(samples, pad_token_id=0)
    # each position's output is its own index in the layout: padded [2, 5], packed [1, 8]
    positions = torch.arange(8.0)[None] if packed else torch.arange(10.0).view(2, 5)
    starts = (0, 5)  # each row's first position: packed after row 0's 5 tokens, padded a row of 5 further
    gathered = megatron_mtp.gather_depth(positions[..., None], mb, 1)[..., 0]
    # response token j of a row sits at prompt_len + j; the decoder predicts it from prompt_len + j - 1, depth 1 from
    # prompt_len + j - 2, depth 2 from prompt_len + j - 3 (none before the row's start: weight 0)
    assert gathered[0].tolist() == [starts[0] + 0, starts[0] + 1, starts[0] + 2]
    assert gathered[1, 1].item() == starts[1] + 0
    assert megatron_mtp.target_weights(mb, 1).tolist() == [[1, 0, 1], [0, 1, 0]]
    assert megatron_mtp.target_weights(mb, 2).tolist() == [[0, 0, 1], [0, 0, 0]]


def test_mtp_jobs_are_checked_at_submit(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "train.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    base = {"hf_checkpoint": str(model), "prompt_data": str(tmp_path / "train.jsonl"), "num_rollout": 1,
            "rollout_batch_size": 1, "train_backend": "megatron", "mtp_num_layers": 1, "enable_mtp_training": True}
    (model / "config.json").write_text(json.dumps(QWEN2))
    assert preflight(parse_spec(base)).mtp_num_layers == 1
    with pytest.raises(InvalidArgument, match="set train_backend: megatron"):
        parse_spec({**base, "train_backend": "fsdp"})
    assert parse_spec({**base, "pipeline_model_parallel_size": 2}).pipeline_model_parallel_size == 2
    assert parse_spec({**base, "context_parallel_size": 2}).context_parallel_size == 2
    with pytest.raises(InvalidArgument, match="multi-token-prediction layers .mtp_num_layers. take text rows only"):
        parse_spec({**base, "multimodal_keys": {"image": "images"}})
    with pytest.raises(InvalidArgument, match="enable_mtp_training needs mtp_num_layers"):
        parse_spec({**base, "mtp_num_layers": None})
    with pytest.raises(InvalidArgument, match=r"mtp_num_layers 2: hf_checkpoint carries 1 multi-token-prediction "
                                              r"layers \(config.json num_nextn_predict_layers\)"):
        preflight(parse_spec({**base, "mtp_num_layers": 2}))
    (model / "config.json").write_text(json.dumps({**QWEN2, "model_type": "qwen3"}))
    with pytest.raises(InvalidArgument, match="model family 'qwen3' carries no multi-token-prediction layers"):
        preflight(parse_spec(base))


def test_qwen3_next_and_qwen3_5_checkpoints_name_their_mtp_layer_under_mtp():
    qwen3_5 = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}}
    assert mtp.checkpoint_layers(qwen3_5) == mtp.checkpoint_layers({"model_type": "qwen3_next",
                                                                    "mtp_num_hidden_layers": 1}) == 1
    assert mtp.problem(qwen3_5, 1) == ""
    assert mtp.problem({"model_type": "qwen3_next"}, 1) == (
        "mtp_num_layers 1: hf_checkpoint carries 0 multi-token-prediction layers (config.json mtp_num_hidden_layers)")
    # its layer's tensors under mtp.layers.0, its norms and projection under mtp.
    assert (mtp.hf_prefix("qwen3_next", 48, 0), mtp.own_prefix("qwen3_next", 48, 0)) == ("mtp.layers.0.", "mtp.")
    assert mtp.hf_names("qwen3_5_moe")["eh_proj.weight"] == "fc.weight"
