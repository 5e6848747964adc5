"""One list of an HF directory's side files, copied by every writer of weights (the snapshot used to miss two)."""

from __future__ import annotations

import torch

from services.trainer.checkpoint.hf_files import SIDE_FILES, TOKENIZER_FILES, copy_side_files
from services.trainer.weight_sync.weight_sync import write_snapshot


def base_model(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "added_tokens.json", "chat_template.json", "tokenizer.json"):
        (base / name).write_text(name)
    (base / "model.safetensors").write_text("weights are not a side file")
    return base


def test_the_engines_snapshot_carries_every_side_file_of_the_base_model(tmp_path):
    snapshot = write_snapshot([("w", torch.zeros(2))], tmp_path / "snapshots", "3", base_model_dir=base_model(tmp_path))
    names = {p.name for p in (tmp_path / "snapshots" / "weight_v3").iterdir()}
    assert snapshot.endswith("weight_v3")
    assert names == {"model.safetensors", "config.json", "added_tokens.json", "chat_template.json", "tokenizer.json"}


def test_copy_takes_only_the_named_files_the_source_has(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    copy_side_files(base_model(tmp_path), dest, TOKENIZER_FILES)
    assert {p.name for p in dest.iterdir()} == {"added_tokens.json", "chat_template.json", "tokenizer.json"}
    assert set(TOKENIZER_FILES) < set(SIDE_FILES) and "config.json" in SIDE_FILES
    copy_side_files(dest, dest)  # onto itself: nothing to do, no error
