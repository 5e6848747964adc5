"""A LoRA job in the rollout manager: every /generate names the job's adapter (SGLang's lora_path) unless the
payload names one itself; the job asks the pool for --enable-lora, --max-lora-rank and --lora-target-modules (what the
chart gives SGLang engines), which the local launcher passes to SGLang and the CPU engines take as flags."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from services.common.plugin_sample import PluginSample
from services.rollout.pool.engine_options import differences, job_engine_options
from services.rollout.pool.launchers import LocalLauncher, cpu_engine_options_argv
from services.rollout.pool.sglang_launcher import sglang_server_args, sglang_server_argv
from tests.unit.rollout_fakes import reply
from tests.unit.test_rollout_generate import call, context


def test_every_generate_of_a_lora_job_names_its_adapter():
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=reply([3], "a"))

    asyncio.run(call(context(handler, lora_name="job-a"), PluginSample()))
    asyncio.run(call(context(handler, lora_name="job-a"), PluginSample(), {"input_ids": [1], "lora_path": "other"}))
    asyncio.run(call(context(handler), PluginSample()))
    assert [body.get("lora_path") for body in seen] == ["job-a", "other", None]


def test_under_lora_sync_disk_each_generate_names_the_version_every_engine_holds():
    """SGLang loads each version under a name of its own: the requests name the pool's settled version's."""
    seen, versions = [], iter(["3", "4", None])

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=reply([3], "a"))

    for _ in range(3):
        version = next(versions)
        asyncio.run(call(context(handler, lora_name="job-a", lora_versioned=True, version_now=lambda v=version: v),
                         PluginSample()))
    asyncio.run(call(context(handler, lora_name="job-a", version_now=lambda: "5"), PluginSample()))  # push: one name
    assert [body["lora_path"] for body in seen] == ["job-a@v3", "job-a@v4", "job-a", "job-a"]


def test_under_lora_sync_disk_a_reply_records_the_version_its_adapter_name_named():
    """SGLang reports one weight_version for every adapter (the last job's to sync where jobs share the pool): the
    versioned name says which version generated the reply."""
    def handler(request):
        return httpx.Response(200, json=reply([3], "a", weight_version="9"))

    versioned = asyncio.run(call(context(handler, lora_name="job-a", lora_versioned=True, version_now=lambda: "3"),
                                 PluginSample()))
    plain = asyncio.run(call(context(handler, lora_name="job-a", version_now=lambda: "3"), PluginSample()))
    assert versioned["meta_info"]["weight_version"] == "3" and plain["meta_info"]["weight_version"] == "9"


def test_a_lora_job_asks_for_lora_serving():
    assert job_engine_options({"lora_rank": 16})["sglang_enable_lora"] is True
    assert "sglang_enable_lora" not in job_engine_options({"lora_rank": 0})


def test_cpu_engines_take_the_lora_options_as_flags():
    argv = cpu_engine_options_argv({"sglang_enable_lora": True, "sglang_lora_target_modules": ["q_proj", "v_proj"],
                                    "sglang_max_lora_rank": 16, "sglang_lora_backend": "triton"})
    assert argv == ["--enable-lora", "True", "--max-lora-rank", "16", "--lora-target-modules", "q_proj,v_proj"]


SGLANG_FLAGS = set(json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_server_flags.json")
                              .read_text())["flags"])
LORA_JOB = {"lora_rank": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def test_the_local_launcher_starts_sglang_for_a_lora_job_with_its_rank_and_modules(tmp_path):
    """SGLang starts no LoRA server without --lora-paths unless it has --max-lora-rank and --lora-target-modules: the
    job's rank and modules, as the chart passes its engines.lora values (the modules one argument each)."""
    launcher = LocalLauncher(lambda port, index: sglang_server_argv("/m", "127.0.0.1", port, {}), tmp_path,
                             options_argv=sglang_server_args)
    launcher.set_engine_options(job_engine_options(LORA_JOB))
    assert launcher.argv_for(30000, 0) + launcher.extra_argv == [
        *sglang_server_argv("/m", "127.0.0.1", 30000, {}), "--enable-lora", "--max-lora-rank", "16",
        "--lora-target-modules", "q_proj", "v_proj", "down_proj"]
    assert {a for a in launcher.extra_argv if a.startswith("--")} <= SGLANG_FLAGS
    # PEFT's dotted suffixes go by their last name, once each: the names SGLang takes
    dotted = job_engine_options({"lora_rank": 8, "target_modules": ["self_attn.q_proj", "q_proj", "mlp.down_proj"]})
    assert dotted["sglang_lora_target_modules"] == ["q_proj", "down_proj"]
    # a job's own sglang_* flags win over the derived ones
    assert job_engine_options({**LORA_JOB, "sglang_max_lora_rank": 64})["sglang_max_lora_rank"] == 64
    assert cpu_engine_options_argv(job_engine_options(LORA_JOB)) == [
        "--enable-lora", "True", "--max-lora-rank", "16", "--lora-target-modules", "q_proj,v_proj,down_proj"]


def test_engines_that_serve_a_larger_rank_or_more_modules_serve_the_job():
    """No relaunch where the engines already serve the job's adapter: the CPU engine's defaults (any rank, every
    module), a larger --max-lora-rank, a superset of the modules or `all`; a smaller rank or a missing module
    differs, naming the flag."""
    options = job_engine_options(LORA_JOB)
    serving = {"cpu": {"enable_lora": True, "max_lora_rank": 0, "lora_target_modules": []},
               "wide": {"enable_lora": True, "max_lora_rank": 64,
                        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]},
               "all": {"enable_lora": True, "max_lora_rank": 16, "lora_target_modules": ["all"]}}
    for name, info in serving.items():
        assert differences(options, {name: info}) == ([], []), name
    narrow = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}
    differ, _ = differences(options, {"http://e": narrow})
    assert differ == ["--sglang-lora-target-modules ['q_proj', 'v_proj', 'down_proj'] (http://e: ['q_proj', 'v_proj'])",
                      "--sglang-max-lora-rank 16 (http://e: 8)"]
    off = differences(options, {"http://e": {"enable_lora": False, "max_lora_rank": None, "lora_target_modules": None}})
    assert len(off[0]) == 3  # an SGLang server started without LoRA: every flag differs
