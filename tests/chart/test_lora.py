"""engines.lora: the chart's values turn on LoRA serving, as SGLang's launch_server flags on SGLang engines and as
the CPU engine's PHYSARUM_ENGINE_* settings on CPU ones; off by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.rollout.pool.engine_options import job_engine_options
from services.rollout.pool.sglang_launcher import sglang_server_args
from tests.chart.chart import containers, env_of, one, render, rendered

SGLANG_FLAGS = set(json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_server_flags.json")
                              .read_text())["flags"])


def engine_container(values: dict) -> dict:
    (container,) = containers(one(render(values), "Deployment", "engine"))
    return container


def test_sglang_engines_get_launch_server_lora_flags():
    container = engine_container({"engines": {"lora": {"enabled": True, "maxLorasPerBatch": 4, "maxLoraRank": 32,
                                                       "targetModules": ["q_proj", "v_proj"]}}})
    args = container["args"]
    assert {"--enable-lora", "--max-loras-per-batch=4", "--max-lora-rank=32"} <= set(args)
    start = args.index("--lora-target-modules")
    assert args[start + 1:start + 3] == ["q_proj", "v_proj"]
    assert [a.split("=", 1)[0] for a in args if a.startswith("--") and a.split("=", 1)[0] not in SGLANG_FLAGS] == []


def test_the_local_launcher_gives_sglang_the_charts_lora_flags_from_the_jobs_settings():
    """The local launcher starts SGLang for a LoRA job of rank 16 on two modules as the chart does with those values
    (the chart also sets --max-loras-per-batch, at SGLang's default of 8)."""
    modules = ["q_proj", "v_proj"]
    args = engine_container({"engines": {"lora": {"enabled": True, "maxLoraRank": 16, "targetModules": modules}}})
    args = [part for arg in args["args"] for part in arg.split("=", 1)]  # --flag=value as the launcher's --flag value
    start = args.index("--enable-lora")
    chart = args[start:start + 6 + len(modules)]
    assert chart[1:3] == ["--max-loras-per-batch", "8"]
    assert sglang_server_args(job_engine_options({"lora_rank": 16, "target_modules": modules})) == \
        chart[:1] + chart[3:]


def test_sglang_engines_default_to_every_module_and_no_lora():
    args = engine_container({"engines": {"lora": {"enabled": True}}})["args"]
    assert args[args.index("--lora-target-modules") + 1] == "all"
    (default,) = containers(one(rendered("default"), "Deployment", "engine"))
    assert not [a for a in default.get("args", []) if "lora" in a]


def test_cpu_engines_get_the_engines_lora_settings():
    container = engine_container({"engines": {"backend": "cpu", "gpus": 0,
                                              "lora": {"enabled": True, "maxLoraRank": 16,
                                                       "targetModules": ["q_proj", "down_proj"]}}})
    env = {name: e.get("value") for name, e in env_of(container).items()}
    assert env["PHYSARUM_ENGINE_ENABLE_LORA"] == "true"
    assert (env["PHYSARUM_ENGINE_MAX_LORA_RANK"], env["PHYSARUM_ENGINE_MAX_LORAS_PER_BATCH"]) == ("16", "8")
    assert env["PHYSARUM_ENGINE_LORA_TARGET_MODULES"] == "q_proj,down_proj"


def test_a_bad_lora_value_fails_the_schema():
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="maxLoraRank"):
        render({"engines": {"lora": {"enabled": True, "maxLoraRank": 0}}})


def test_lora_engines_read_the_checkpoints_volume_whatever_their_join_mode():
    """lora_sync disk, SGLang's route: each adapter version is a directory on the checkpoints volume (the pool's
    snapshot, or a job's update_weight_disk_dir), so engines that serve LoRA mount it read-only even when they join
    by sync."""
    def checkpoints_mount(values: dict) -> dict | None:
        engine = one(render(values), "Deployment", "engine")
        volumes = {v["name"] for v in engine["spec"]["template"]["spec"].get("volumes", [])}
        (container,) = containers(engine)
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        assert ("checkpoints" in volumes) == ("checkpoints" in mounts)
        return mounts.get("checkpoints")

    mount = checkpoints_mount({"engines": {"joinMode": "sync", "lora": {"enabled": True}}})
    assert mount is not None and mount["readOnly"] is True and mount["mountPath"] == "/checkpoints"
    assert checkpoints_mount({"engines": {"joinMode": "sync"}}) is None


@pytest.mark.parametrize("persistence, message", [
    ({"enabled": False}, r"engines.lora needs a volume the trainer and the engines share"),
    ({"accessMode": "ReadWriteOnce"}, r"ReadWriteOnce: the trainer and the engines \(engines.lora\) share the volume"),
])
def test_lora_engines_without_a_shared_checkpoints_volume_fail_the_render(persistence, message):
    import helm_python as helm

    with pytest.raises(helm.HelmRenderError, match=message):
        render({"engines": {"joinMode": "sync", "lora": {"enabled": True}},
                "checkpoints": {"persistence": persistence}})
