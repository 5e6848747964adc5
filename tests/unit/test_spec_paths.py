"""Job spec paths stay inside the trainer's configured roots, after normalisation."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.trainer.spec_defaults import spec_parser
from services.trainer.spec_paths import PathRoots


@pytest.fixture
def roots(tmp_path) -> PathRoots:
    for name in ("data", "ckpt", "out"):
        (tmp_path / name).mkdir()
    return PathRoots(data=(str(tmp_path / "data"),), checkpoints=(str(tmp_path / "ckpt"),),
                     exports=(str(tmp_path / "out"),))


def spec(tmp_path, **overrides) -> dict:
    return {"hf_checkpoint": str(tmp_path / "data" / "model"), "prompt_data": f"{tmp_path}/data/train.jsonl@[0:8]",
            "num_rollout": 2, "rollout_batch_size": 2, **overrides}


def test_paths_inside_their_roots_pass(tmp_path, roots):
    parse = spec_parser({}, roots)
    job = parse(spec(tmp_path, save=str(tmp_path / "ckpt" / "run"), load=str(tmp_path / "ckpt" / "run"),
                     save_hf=str(tmp_path / "out" / "hf_{rollout_id}"),
                     save_debug_rollout_data=str(tmp_path / "out" / "dump_{rollout_id}.pt")))
    assert job.save.endswith("ckpt/run")


@pytest.mark.parametrize("override", [
    {"save": "{tmp}/ckpt/../../etc"}, {"save": "{tmp}/out/run"}, {"save_hf": "{tmp}/ckpt/../out/../../x"},
    {"save_debug_rollout_data": "/tmp/elsewhere/{{rollout_id}}.pt"}, {"prompt_data": "/etc/passwd"},
    {"prompt_data": "{tmp}/data/../../secret.jsonl@[0:1]"}, {"load": "/etc"}, {"hf_checkpoint": "/"},
    {"ref_load": "{tmp}/data/\x00x"}, {"update_weight_disk_dir": "{tmp}/data/weights"},
])
def test_paths_outside_their_roots_are_refused_by_key(tmp_path, roots, override):
    key, value = next(iter(override.items()))
    with pytest.raises(InvalidArgument, match=f"job spec: .*{key.split('_')[0]}"):
        spec_parser({}, roots)(spec(tmp_path, **{key: value.format(tmp=tmp_path)}))


def test_no_roots_confine_nothing(tmp_path):
    assert spec_parser({})(spec(tmp_path, save="/anywhere/ckpt")).save == "/anywhere/ckpt"
