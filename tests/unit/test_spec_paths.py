"""Job spec paths stay inside the trainer's configured roots, after normalisation."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.spec_defaults import spec_parser
from services.trainer.api.spec_paths import PathRoots


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


def test_physarum_up_confines_paths_by_default(tmp_path, monkeypatch):
    """The flags `physarum up` gives the trainer, parsed as the trainer parses them: without --root, paths under
    the current directory, the work dir's parent and the stack's private files directory pass; /etc, the home
    directory and the world-writable temp dir do not."""
    from physarum.stack import StackOptions, root_flags
    from services.common.config import load_config
    from services.trainer.api.config import TrainerConfig
    from services.trainer.api.spec_defaults import path_roots

    monkeypatch.chdir(tmp_path)
    work_dir = tmp_path / "stack"
    trainer_flags, buffer_flags = root_flags(StackOptions(work_dir=work_dir, model_path=tmp_path / "m"), work_dir)
    assert buffer_flags[0] == "--data-roots" and str(tmp_path) in buffer_flags[1].split(",")
    parse = spec_parser({}, path_roots(load_config(TrainerConfig, "trainer", trainer_flags)))
    base = {"hf_checkpoint": str(tmp_path / "m"), "prompt_data": str(tmp_path / "d.jsonl"), "num_rollout": 2,
            "rollout_batch_size": 2}
    assert parse({**base, "save": str(tmp_path / "ckpt"), "save_hf": str(work_dir / "files" / "hf")}).save == \
        str(tmp_path / "ckpt")
    escape = str(tmp_path.joinpath(*[".."] * len(tmp_path.parts), "etc", "x"))  # <tmp_path>/../../../../etc/x
    refused = [("prompt_data", "/etc/passwd"), ("save", escape),
               ("save_hf", str(Path.home() / ".ssh" / "x")), ("load", "/etc"), ("save_debug_rollout_data", "/etc/x"),
               ("save_hf", "/tmp/hf")]
    for key, path in refused:
        with pytest.raises(InvalidArgument, match="lies outside the allowed directories"):
            parse({**base, key: path})
    own = load_config(TrainerConfig, "trainer", root_flags(StackOptions(work_dir=work_dir, path_roots=(
        tmp_path / "only",)), work_dir)[0])  # `physarum up --root DIR`: only DIR
    with pytest.raises(InvalidArgument, match="job spec: save .* lies outside"):
        spec_parser({}, path_roots(own))({**base, "hf_checkpoint": str(tmp_path / "only" / "m"),
                                          "prompt_data": str(tmp_path / "only" / "d.jsonl"), "save": "/tmp/x"})
