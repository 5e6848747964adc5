"""slime's own torch_dist checkpoints of the gated delta-net families, as its HF-module spec writes them (`--spec
slime_plugins.models.qwen3_5` / `qwen3_next`: each linear-attention layer's transformers module and input norm under
`decoder.layers.N.self_attention.`, the rest megatron-core's Transformer Engine names): the Megatron backend loads one
(`slime_to_hf`, what train_backend fsdp runs at start, loads it as --load does and exports it), and the export holds
the HF weights the checkpoint was written from, tensor by tensor, in one process and at TP=2 (two gloo ranks of
tests/integration/megatron_slime_gdn_worker.py, each converting its own shards). One lacking a tensor fails naming
it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration import family_parity
from tests.integration.workers import run_worker

MEGATRON_LM_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                        "common_backend": "torch", "common_backend_version": 1}


def _teacher(family_dir: Path, out: Path) -> Path:
    """The tiny family model with every weight moved (the job's --hf-checkpoint stays the original)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    return family_parity.save_beside_tokenizer(model, family_dir, out)


def slime_layout(hf: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
    """What slime's save of the model holds, by key: its linear-attention layers as `self_attention.linear_attn.*`
    (transformers' parameter names) and `self_attention.input_layernorm.weight`, the others megatron-core's."""
    from services.trainer.checkpoint import hf_io, megatron_convert
    from services.trainer.models.arch import ModelArch

    arch = ModelArch.from_hf_config(hf_io.read_config(model_dir))
    state = megatron_convert.hf_to_megatron(hf, arch, te_names=True)
    for layer in range(arch.num_layers):
        if not arch.is_linear_layer(layer):
            continue
        mg, hf_layer = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        state = {key: t for key, t in state.items()
                 if not key.startswith(mg + "self_attention.") and key != mg + "input_layernorm.weight"}
        state[mg + "self_attention.input_layernorm.weight"] = hf[hf_layer + "input_layernorm.weight"]
        state.update({mg + "self_attention." + name.removeprefix(hf_layer): t for name, t in hf.items()
                      if name.startswith(hf_layer + "linear_attn.")})
    assert any(".self_attention.linear_attn." in key for key in state)
    return _stacked_experts(state)


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core checkpoints a layer's experts as one tensor per projection, stacked along a leading expert axis
    (mlp.experts.experts.linear_fc1.weight), not under the modules' local_experts.{e}. names."""
    out, experts = {}, {}
    for key, tensor in state.items():
        match = re.fullmatch(r"(.+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)", key)
        if match:
            experts.setdefault(match.group(1) + "experts." + match.group(3), {})[int(match.group(2))] = tensor
        else:
            out[key] = tensor
    out.update({key: torch.stack([by_index[e] for e in sorted(by_index)]) for key, by_index in experts.items()})
    return out


def save_torch_dist(state: dict[str, torch.Tensor], root: Path) -> None:
    """Megatron-LM's files of a release checkpoint: the tensors by torch.distributed.checkpoint under their keys,
    its metadata.json and the latest file."""
    import torch.distributed.checkpoint as dcp

    dcp.save({key: t.contiguous() for key, t in state.items()}, checkpoint_id=str(root / "release"), no_dist=True)
    (root / "release" / "metadata.json").write_text(json.dumps(MEGATRON_LM_METADATA))
    (root / "latest_checkpointed_iteration.txt").write_text("release")


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def slime_to_hf(hf_checkpoint: Path, root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.trainer.driver.slime_to_hf", "--hf-checkpoint",
                           str(hf_checkpoint), "--load", str(root), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_slimes_hf_module_gated_delta_net_checkpoint_loads_with_its_weights(family_model_dir, tmp_path, family):
    from safetensors.torch import load_file

    student = family_model_dir(family)
    teacher = _teacher(student, tmp_path / "teacher")
    state = slime_layout(load_file(teacher / "model.safetensors"), teacher)
    save_torch_dist(state, tmp_path / "root")

    run = slime_to_hf(student, tmp_path / "root", tmp_path / "hf")
    assert run.returncode == 0, run.stderr[-3000:]
    # compared as transformers holds them (the export writes experts fused, the files on disk name each one)
    got, want = _weights(tmp_path / "hf"), _weights(teacher)
    assert got.keys() == want.keys()
    for name, weight in want.items():
        assert torch.equal(got[name], weight), name
    assert any(not torch.equal(got[name], weight) for name, weight in _weights(student).items())

    if family == "qwen3_5":  # a checkpoint lacking one of a gated delta-net's tensors names it
        lacking = "decoder.layers.0.self_attention.linear_attn.dt_bias"
        save_torch_dist({key: t for key, t in state.items() if key != lacking}, tmp_path / "broken")
        run = slime_to_hf(student, tmp_path / "broken", tmp_path / "hf-broken")
        assert run.returncode != 0
        assert lacking in run.stderr


def test_each_tensor_parallel_rank_loads_its_shards_of_slimes_gated_delta_nets(family_model_dir, tmp_path):
    from safetensors.torch import load_file

    student = family_model_dir("qwen3_5")
    teacher = _teacher(student, tmp_path / "teacher")
    save_torch_dist(slime_layout(load_file(teacher / "model.safetensors"), teacher), tmp_path / "root")
    run_worker("tests.integration.megatron_slime_gdn_worker", str(tmp_path), str(student), str(tmp_path / "root"),
               log_path=tmp_path / "worker.log", timeout_s=600)
    got, want = _weights(tmp_path / "hf"), _weights(teacher)
    assert got.keys() == want.keys()
    for name, weight in want.items():
        assert torch.equal(got[name], weight), name
