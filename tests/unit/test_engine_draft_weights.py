"""The CPU engine serving a checkpoint with multi-token-prediction layers (a tiny MiMo, testkit/mtp_checkpoints.py): it
decodes without a draft model, holds the checkpoint's MTP weights aside, and takes the trainer's MTP weights in a
sync where SGLang loads them into its speculative draft model; a name past the checkpoint's MTP layers is still
refused. The same for a tiny Qwen3-Next's (mtp.*)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidArgument
from services.engine.generation import Engine, load_model
from services.engine.weights import WeightUpdater
from testkit.mtp_checkpoints import build_tiny_mimo, build_tiny_qwen_next_with_mtp
from tests.model_families import TOKENIZER_FILES


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory, tiny_model_dir):
    model_dir = build_tiny_mimo(tmp_path_factory.mktemp("mimo") / "model", 1)
    for name in TOKENIZER_FILES:  # the engine loads one; the test decodes nothing
        if (tiny_model_dir / name).exists():
            (model_dir / name).write_bytes((tiny_model_dir / name).read_bytes())
    return model_dir


def test_the_engine_keeps_and_takes_the_mtp_weights(mimo_dir, tmp_path):
    model, tokenizer = load_model(str(mimo_dir))
    engine = Engine(model, tokenizer, max_batch_size=1)
    updater = WeightUpdater(engine, timeout_s=30.0)
    checkpoint = load_file(mimo_dir / "model.safetensors")
    mtp = {name: t for name, t in checkpoint.items() if name.startswith("model.mtp_layers.")}
    assert updater.draft.keys() == mtp.keys() and len(mtp) == 16
    # a sync as the trainer writes it: every weight, the MTP ones changed
    sent = {**{name: t.clone() for name, t in model.state_dict().items() if name != "lm_head.weight" or
               not model.config.tie_word_embeddings}, **{name: t + 1.0 for name, t in mtp.items()}}
    save_file(sent, tmp_path / "model.safetensors")
    updater.update_from_disk(str(tmp_path), weight_version="1")
    name = "model.mtp_layers.0.input_proj.weight"
    assert updater.get_weights(name, 4) == pytest.approx((mtp[name] + 1.0).flatten()[:4].tolist())
    assert engine.weight_version == "1"
    with pytest.raises(InvalidArgument, match="unknown parameter 'model.mtp_layers.1.input_proj.weight'"):
        updater._check([("model.mtp_layers.1.input_proj.weight", (64, 128))])
    with pytest.raises(InvalidArgument, match="does not match the model's"):
        updater._check([(name, (64, 64))])
    assert torch.equal(updater.draft[name], mtp[name] + 1.0)


def test_the_engine_keeps_and_takes_qwen3_next_mtp_weights(tiny_model_dir, tmp_path):
    model_dir = build_tiny_qwen_next_with_mtp(tmp_path / "qwen3_next")
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).exists():
            (model_dir / name).write_bytes((tiny_model_dir / name).read_bytes())
    model, tokenizer = load_model(str(model_dir))
    updater = WeightUpdater(Engine(model, tokenizer, max_batch_size=1), timeout_s=30.0)
    mtp = {name: t for name, t in load_file(model_dir / "model.safetensors").items() if name.startswith("mtp.")}
    assert updater.draft.keys() == mtp.keys() and "mtp.fc.weight" in mtp
    sent = {**{name: t.clone() for name, t in model.state_dict().items()},
            **{name: t + 1.0 for name, t in mtp.items()}}
    sync = tmp_path / "sync"  # a sync as the trainer writes it: every weight, the MTP ones changed
    sync.mkdir()
    save_file(sent, sync / "model.safetensors")
    updater.update_from_disk(str(sync), weight_version="1")
    assert all(torch.equal(updater.draft[name], tensor + 1.0) for name, tensor in mtp.items())
