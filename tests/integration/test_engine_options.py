"""A job's --sglang-* flags reach the engines: a pool that launches its engines (fake-compute CPU engines, local
processes, behind the real router) relaunches them with the options they take, checked through each engine's
/server_info; a pool of engines it did not launch fails the job naming each flag that disagrees."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.common.errors import FailedPrecondition
from services.common.settings.rollout import RolloutConfig
from services.rollout.client import EngineState
from services.rollout.pool.config import PoolConfig
from services.rollout.pool.engine_options import apply_job_options, job_engine_options
from services.rollout.pool.launchers import LocalLauncher, cpu_engine_argv, cpu_engine_options_argv
from services.rollout.pool.pool import EnginePool
from services.rollout.server import RolloutServicer

SLIME_ARGS = {"sglang_dtype": "bfloat16", "sglang_mem_fraction_static": 0.7, "sglang_router_port": 3000,
              "sglang_server_concurrency": 512, "sglang_context_length": None}


def pool_config(replicas: int) -> PoolConfig:
    return PoolConfig(replicas=replicas, join_mode="sync", health_check_interval_s=0.5, health_check_timeout_s=5.0,
                      start_timeout_s=60.0)


def test_the_jobs_server_options_are_the_sglang_flags_that_are_server_arguments():
    assert job_engine_options(SLIME_ARGS) == {"sglang_dtype": "bfloat16", "sglang_mem_fraction_static": 0.7}
    # routing replay of the rollout's experts: SGLang engines must be launched to return them
    assert job_engine_options({"use_rollout_routing_replay": True}) == {"sglang_enable_return_routed_experts": True}


def test_a_pool_that_launches_its_engines_relaunches_them_with_the_jobs_options(tiny_model_dir, shared_router,
                                                                               tmp_path):
    async def main() -> tuple[list[str], list[dict], list[int], list[int]]:
        argv = cpu_engine_argv(str(tiny_model_dir), fake_compute=True)
        launcher = LocalLauncher(argv, tmp_path / "engines", options_argv=cpu_engine_options_argv)
        pool = EnginePool(launcher, shared_router, pool_config(2))
        await asyncio.wait_for(pool.start(), 90)
        try:
            before = [e.pid for e in pool.records.values()]
            # what StartRollout and RunEval do first, with the job's args (slime's, converted)
            servicer = RolloutServicer(manager=None, pool=pool, pool_ready=asyncio.Event(), router_url="")
            servicer.pool_ready.set()
            await servicer._engines_for(RolloutConfig(job_id="job-a", rollout_batch_size=1, args=SLIME_ARGS))
            serving = [e for e in pool.records.values() if e.state == EngineState.SERVING]
            infos = [httpx.get(f"{e.url}/server_info", timeout=10).json() for e in serving]
            notes = await apply_job_options(pool, "job-a", job_engine_options(SLIME_ARGS), timeout_s=90)
            return notes, infos, before, [e.pid for e in serving]
        finally:
            await pool.close()

    notes, infos, before, after = asyncio.run(main())
    assert [info["dtype"] for info in infos] == ["bfloat16", "bfloat16"]  # both engines relaunched with --dtype
    assert len(after) == 2 and not set(after) & set(before)  # new processes
    # again: nothing to relaunch; the CPU engine has no --mem-fraction-static, which is noted
    assert notes == ["--sglang-mem-fraction-static: not an option of the pool's engines (their /server_info does "
                     "not report it); not applied"]


def test_a_pool_it_did_not_launch_fails_the_job_naming_each_flag(cpu_engine_url, shared_router):
    async def main() -> None:
        pool = EnginePool(None, shared_router, pool_config(0), external_urls=[cpu_engine_url])
        await asyncio.wait_for(pool.start(), 60)
        try:
            await apply_job_options(pool, "job-b", {"sglang_dtype": "bfloat16", "sglang_max_batch_size": 64},
                                    timeout_s=10)
        finally:
            await pool.close()

    with pytest.raises(FailedPrecondition) as err:
        asyncio.run(main())
    assert str(err.value) == (
        f"job job-b: its engine options disagree with the engine pool, whose engines it did not launch: "
        f"--sglang-dtype bfloat16 ({cpu_engine_url}: float32); set them on the rollout service (--sglang-args, "
        f"Helm engines.sglang.extraArgs) or drop them from the job")
