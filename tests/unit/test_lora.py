"""LoRA on the fsdp backend, on the tiny model: adapter-on log-probs equal the merged model's, the base frozen and out
of the optimizer, the reference (adapters off) equal to the base, adapter-only checkpoints, the PEFT export, and the
spec's refusal on megatron."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.api.spec import JobSpec, parse_spec
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.checkpoint.torch_state import load_causal_lm
from services.trainer.lora import layers as lora_layers
from services.trainer.settings.train import TrainConfig
from services.trainer.slime_flags import args as slime_args
from tests.tiny_samples import samples_of

ROLLOUT = [("1+2=", "3", 1.0), ("1+2=", "4", 0.0), ("12+34=", "46", 0.0), ("12+34=", "55", 1.0)]
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture
def samples(tiny_model_dir) -> list[Sample]:
    return samples_of(tiny_model_dir, ROLLOUT)


def make_backend(model_dir, **overrides) -> TorchBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-2, "micro_batch_size": 4, "bf16": False,
                            **overrides})
    return TorchBackend(model_dir, config, num_threads=1)


def randomize_adapters(backend: TorchBackend) -> None:
    """B is zero at init (the adapter adds nothing): give it values so the adapter changes the outputs."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, layer in lora_layers.lora_layers(backend.model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.5)


def base_weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.model.named_parameters() if "lora_" not in name}


def test_adapter_log_probs_equal_the_merged_model(tiny_model_dir, samples):
    lora = make_backend(tiny_model_dir, **LORA)
    randomize_adapters(lora)
    plain = make_backend(tiny_model_dir)
    before = plain.compute_log_probs(samples)
    merged = dict(lora.named_weights())  # what the engines get: W + alpha/r · B @ A under the HF names
    assert not any("lora_" in name for name in merged)
    loaded = plain.model.load_state_dict(merged, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied to the embeddings
    got, want = lora.compute_log_probs(samples), plain.compute_log_probs(samples)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-5)
    assert max(abs(x - y) for g, b in zip(got, before, strict=True) for x, y in zip(g, b, strict=True)) > 1e-3


def test_a_fresh_adapter_changes_nothing_and_the_wrapped_layers_keep_their_names(tiny_model_dir, samples):
    lora, plain = make_backend(tiny_model_dir, **LORA), make_backend(tiny_model_dir)
    for g, w in zip(lora.compute_log_probs(samples), plain.compute_log_probs(samples), strict=True):
        assert g == pytest.approx(w, abs=1e-6)
    names = {name for name, _ in lora.model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert "model.layers.0.self_attn.k_proj.lora_A.weight" not in names  # not targeted


def test_base_is_frozen_and_outside_the_optimizer_and_the_adapters_learn(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, **LORA, use_kl_loss=True, kl_loss_coef=0.1)
    assert backend.ref_model is None  # the reference is the policy with the adapters off, not a copy
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    adapters = {name: p for name, p in backend.model.named_parameters() if "lora_" in name}
    assert optimized == {id(p) for p in adapters.values()}
    assert not any(p.requires_grad for name, p in backend.model.named_parameters() if "lora_" not in name)
    base = base_weights(backend)
    adapters_before = {name: p.detach().clone() for name, p in adapters.items()}
    for _ in range(2):
        backend.train_rollout(samples)
    for name, weight in base_weights(backend).items():
        assert torch.equal(weight, base[name]), name
    assert any(not torch.equal(p, adapters_before[name]) for name, p in adapters.items())
    b_moved = [name for name in adapters if name.endswith("lora_B.weight") and adapters[name].abs().max() > 0]
    assert b_moved


def test_reference_log_probs_are_the_base_models(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, **LORA, use_kl_loss=True, kl_loss_coef=0.1)
    randomize_adapters(backend)
    base = make_backend(tiny_model_dir).compute_log_probs(samples)
    with lora_layers.adapters_disabled(backend.model):
        reference = backend.compute_log_probs(samples)
    for r, b in zip(reference, base, strict=True):
        assert r == pytest.approx(b, abs=1e-6)
    on = backend.compute_log_probs(samples)  # the adapters are back on after the block
    assert max(abs(x - y) for o, b in zip(on, base, strict=True) for x, y in zip(o, b, strict=True)) > 1e-3
    # the training path's reference is the same: at the adapted policy the KL to it is not zero
    (metrics,) = backend.train_rollout(samples)
    assert metrics["train/kl_loss"] > 1e-4


def test_checkpoint_holds_the_adapter_and_its_optimizer_state_only(tiny_model_dir, samples, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    backend = make_backend(tiny_model_dir, **LORA)
    backend.train_rollout(samples)
    backend.save_sharded(tmp_path / "ckpt")
    saved = set(FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    model_keys = {key.removeprefix("model.") for key in saved if key.startswith("model.")}
    assert model_keys and all("lora_" in key for key in model_keys)
    assert all("lora_" in key for key in saved if key.startswith("optim.state."))

    restored = make_backend(tiny_model_dir, **LORA)
    restored.load_sharded(tmp_path / "ckpt")
    want = dict(backend.model.named_parameters())
    for name, p in restored.model.named_parameters():
        assert torch.equal(p, want[name]), name
    state = {id(p): name for name, p in restored.model.named_parameters()}
    want_state = {name: backend.optimizer.state[p] for name, p in backend.model.named_parameters() if p.requires_grad}
    for p, s in restored.optimizer.state.items():
        assert torch.equal(s["exp_avg"], want_state[state[id(p)]]["exp_avg"])
    assert restored.weight_version == backend.weight_version == 1
    # and it trains on from there as the original does
    (a,), (b,) = backend.train_rollout(samples), restored.train_rollout(samples)
    assert a["train/pg_loss"] == pytest.approx(b["train/pg_loss"], abs=1e-6)


def test_hf_export_is_a_peft_adapter_and_on_request_the_merged_model(tiny_model_dir, samples, tmp_path):
    backend = make_backend(tiny_model_dir, **LORA, lora_save_merged=True)
    randomize_adapters(backend)
    backend.save_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    tensors = load_file(tmp_path / "out" / "adapter_model.safetensors")
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a.shape[0] == 4 and b.shape[1] == 4
    assert all(key.startswith("base_model.model.") and "lora_" in key for key in tensors)
    merged = load_causal_lm(tmp_path / "out" / "merged")
    q = backend.model.model.layers[0].self_attn.q_proj
    want = q.weight + 2.0 * q.lora_B.weight @ q.lora_A.weight
    assert torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, want, atol=1e-6)
    assert not torch.allclose(want, q.weight)


def test_a_target_that_matches_nothing_is_named(tiny_model_dir):
    with pytest.raises(InvalidArgument, match="target_modules: qkv_proj match no Linear layer"):
        make_backend(tiny_model_dir, lora_rank=4, target_modules=["q_proj", "qkv_proj"])


BASE_SPEC = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 4,
             "n_samples_per_prompt": 8}


def test_lora_on_megatron_is_refused_at_submit_naming_fsdp():
    with pytest.raises(InvalidArgument, match="lora_rank: train_backend megatron .* set train_backend: fsdp"):
        parse_spec({**BASE_SPEC, "train_backend": "megatron", "lora_rank": 8})
    assert parse_spec({**BASE_SPEC, "train_backend": "fsdp", "lora_rank": 8}).lora_rank == 8
    with pytest.raises(InvalidArgument, match="ref_load and ref_update_interval do not apply"):
        parse_spec({**BASE_SPEC, "train_backend": "fsdp", "lora_rank": 8, "use_kl_loss": True, "ref_load": "/r"})
    with pytest.raises(InvalidArgument, match="lm_head takes no adapter"):
        parse_spec({**BASE_SPEC, "lora_rank": 8, "target_modules": ["lm_head"]})


def test_lora_refuses_the_sync_paths_its_adapter_does_not_take():
    for key, value in (("weight_sync_backend", "disk"), ("update_weight_mode", "delta")):
        with pytest.raises(InvalidArgument, match="lora_rank: the adapter .* syncs whole over the weight-update "
                                                  "group"):
            parse_spec({**BASE_SPEC, "lora_rank": 8, key: value, "update_weight_disk_dir": "/shared"})


def test_slime_style_lora_flags_set_the_spec_keys():
    argv = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.05", "--target-modules", "q_proj,k_proj",
            "v_proj"]
    spec = slime_args.convert(argv, spec_keys=set(JobSpec.model_fields), check_architecture=False).spec
    assert (spec["lora_rank"], spec["lora_alpha"], spec["lora_dropout"]) == (16, 32.0, 0.05)
    assert spec["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    bad = slime_args.convert(["--lora-rank", "big"], spec_keys=set(JobSpec.model_fields), check_architecture=False)
    assert bad.invalid == ["--lora-rank: invalid int value: 'big'"]


def test_lora_sync_is_a_spec_key_and_a_flag():
    spec = slime_args.convert(["--lora-sync", "disk"], spec_keys=set(JobSpec.model_fields),
                              check_architecture=False).spec
    assert spec["lora_sync"] == "disk"
    assert parse_spec({**BASE_SPEC, "lora_rank": 8, "lora_sync": "disk"}).sync.lora_sync == "disk"
    assert parse_spec({**BASE_SPEC, "lora_rank": 8}).sync.lora_sync == "auto"
    with pytest.raises(InvalidArgument, match="lora_sync"):
        parse_spec({**BASE_SPEC, "lora_rank": 8, "lora_sync": "sideways"})


def test_loading_an_hf_checkpoint_replaces_the_base_and_keeps_the_adapters(tiny_model_dir, tmp_path):
    plain = make_backend(tiny_model_dir)
    with torch.no_grad():
        plain.model.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    plain.save_hf(tmp_path / "base")
    backend = make_backend(tiny_model_dir, **LORA)
    randomize_adapters(backend)
    adapters = {name: p.detach().clone() for name, p in backend.model.named_parameters() if "lora_" in name}
    backend.load(tmp_path / "base")
    q = backend.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight, plain.model.model.layers[0].self_attn.q_proj.weight)
    assert all(torch.equal(p, adapters[name]) for name, p in backend.model.named_parameters() if "lora_" in name)
    assert {id(p) for g in backend.optimizer.param_groups for p in g["params"]} == \
        {id(p) for name, p in backend.model.named_parameters() if "lora_" in name}
