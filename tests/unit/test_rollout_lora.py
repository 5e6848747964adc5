"""A LoRA job in the rollout manager: every /generate names the job's adapter (SGLang's lora_path) unless the
payload names one itself; the job asks the pool for --enable-lora; the CPU engines take the LoRA options as flags."""

from __future__ import annotations

import asyncio
import json

import httpx

from services.common.plugin_sample import PluginSample
from services.rollout.pool.engine_options import job_engine_options
from services.rollout.pool.launchers import cpu_engine_options_argv
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
