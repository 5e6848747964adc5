"""slime_conversion without megatron-core: which paths of a job are converted, where the copies go, what the converter
process is started with, and a failed conversion named. (The conversion itself, and an fsdp backend starting from
its output, run in tests/integration/test_megatron_slime_checkpoint.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from services.common.errors import InvalidArgument
from services.trainer.distributed.parallel import World
from services.trainer.driver import slime_checkpoint_conversion
from services.trainer.settings.driver import DriverConfig


def slime_root(path, iteration: str = "release"):
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    (path / name).mkdir(parents=True)
    for file in ("metadata.json", ".metadata"):
        (path / name / file).write_text("{}")
    (path / "latest_checkpointed_iteration.txt").write_text(iteration)
    return path


def driver(tmp_path, **paths) -> DriverConfig:
    return DriverConfig(hf_checkpoint=str(tmp_path / "hf"), prompt_data=str(tmp_path / "p.jsonl"), num_rollout=1,
                        **paths)


def test_only_slimes_checkpoints_are_converted_each_under_the_save_root(tmp_path, monkeypatch):
    ref = slime_root(tmp_path / "Qwen3-8B_torch_dist")
    teacher = slime_root(tmp_path / "teacher_torch_dist", "5")
    hf = tmp_path / "policy-hf"
    (hf / "config.json").parent.mkdir()
    (hf / "config.json").write_text("{}")
    calls = []

    def fake_run(command, *, env, **kwargs):
        calls.append((command, env))
        out = command[command.index("--out") + 1]
        (tmp_path / out).mkdir(parents=True)
        (tmp_path / out / "config.json").write_text("{}")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(slime_checkpoint_conversion.subprocess, "run", fake_run)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "29500")
    job = driver(tmp_path, ref_load=str(ref), opd_teacher_load=str(teacher), opd_teacher_ckpt_step=5, load=str(hf),
                 save=str(tmp_path / "save"))
    converted = slime_checkpoint_conversion.converted_paths(job, World())
    assert converted.load == str(hf)  # an HF directory stays as it is
    assert converted.opd_teacher_ckpt_step is None  # the copy is of that step
    for path in (converted.ref_load, converted.opd_teacher_load):
        assert path.startswith(str(tmp_path / "save" / "slime_hf" / ""))
    assert [c[0][c[0].index("--load") + 1] for c in calls] == [str(ref), str(teacher)]
    assert calls[1][0][-2:] == ["--ckpt-step", "5"]
    for _, env in calls:  # a world of its own, on the CPU
        assert "WORLD_SIZE" not in env and "MASTER_PORT" not in env and env["CUDA_VISIBLE_DEVICES"] == ""
    assert slime_checkpoint_conversion.converted_paths(job, World()) == converted and len(calls) == 2  # converted once
    os.utime(ref / "release" / "metadata.json", ns=(1, 1))  # written again: a new copy
    assert slime_checkpoint_conversion.converted_paths(job, World()).ref_load != converted.ref_load and len(calls) == 3


def test_a_failed_conversion_names_the_checkpoint_and_the_converters_error(tmp_path, monkeypatch):
    root = slime_root(tmp_path / "broken_torch_dist")
    monkeypatch.setattr(slime_checkpoint_conversion.subprocess, "run",
                        lambda command, **kwargs: subprocess.CompletedProcess(
                            command, 1, "", "InvalidArgument: checkpoint: no tensor decoder.final_layernorm.weight"))
    with pytest.raises(InvalidArgument, match=r"slime's checkpoint .*broken_torch_dist/release: the conversion to HF "
                                              r"failed \(exit 1\): .*no tensor decoder.final_layernorm.weight"):
        slime_checkpoint_conversion.converted_paths(driver(tmp_path, load=str(root), save=str(tmp_path / "save")),
                                                    World())
    assert list((tmp_path / "save" / "slime_hf").iterdir()) == []  # nothing a later job would take for a copy
