"""A job's SGLang server options (slime's `--sglang-*` flags, in its args as `sglang_<flag>`) against what the pool's
engines run with, as each engine's /server_info reports it (slime checks external engines the same way).

Options the engines report differently are applied by relaunching the engines when the pool launches them itself (a
launcher that takes options); a pool it did not launch that way fails the job naming each flag. Options no engine
reports are not server arguments of these engines (the CPU engine has only some of SGLang's): they are noted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from services.common.errors import FailedPrecondition, PhysarumError, Unavailable
from services.rollout.client import EngineState

log = logging.getLogger(__name__)

PREFIX = "sglang_"
# slime's own --sglang-* flags that are not SGLang server arguments (the router's address, slime's concurrency cap)
NOT_SERVER_ARGS = frozenset({"sglang_router_ip", "sglang_router_port", "sglang_router_request_timeout_secs",
                             "sglang_server_concurrency"})
POLL_S = 0.5


def job_engine_options(args: Mapping[str, Any]) -> dict[str, Any]:
    """The server options a job sets: its `sglang_<flag>` args that are SGLang server arguments, None left out; and
    under use_rollout_routing_replay SGLang's enable_return_routed_experts, which slime sets for it (SGLang answers
    return_routed_experts only then; the CPU engine always does)."""
    options = {key: value for key, value in args.items()
               if key.startswith(PREFIX) and key not in NOT_SERVER_ARGS and value is not None}
    if args.get("use_rollout_routing_replay"):
        options.setdefault(PREFIX + "enable_return_routed_experts", True)
    if args.get("lora_rank"):  # a LoRA job: the engines serve its adapter over the base model
        options.update({key: value for key, value in lora_serving_options(args).items() if key not in options})
    return options


def lora_serving_options(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a LoRA job (`lora_rank`, `target_modules`) needs of SGLang's server: --enable-lora, and --max-lora-rank
    and --lora-target-modules, without which SGLang starts no LoRA server that has no --lora-paths (the chart sets
    them from its engines.lora values). A dotted target (PEFT's suffix rule, `mlp.down_proj`) goes by its last name,
    the only form SGLang takes: every module of that name may then take an adapter."""
    options: dict[str, Any] = {PREFIX + "enable_lora": True, PREFIX + "max_lora_rank": int(args["lora_rank"])}
    if args.get("target_modules"):
        names = [str(target).rsplit(".", 1)[-1] for target in args["target_modules"]]
        options[PREFIX + "lora_target_modules"] = list(dict.fromkeys(names))
    return options


def _serves(option: str, wanted: Any, reported: Any) -> bool:
    """Whether an engine reporting `reported` for server option `option` serves the job's `wanted`: an adapter rank
    up to its --max-lora-rank (0: any, the CPU engine's default) and adapters on a subset of its
    --lora-target-modules (none or `all`: every module) do; other options must be equal."""
    if option == "max_lora_rank" and all(isinstance(v, int) and not isinstance(v, bool) for v in (wanted, reported)):
        return reported == 0 or reported >= wanted
    if option == "lora_target_modules" and isinstance(reported, (list, tuple)):
        served = {str(m) for m in reported}
        modules = {wanted} if isinstance(wanted, str) else {str(m) for m in wanted or ()}
        return not served or "all" in served or modules <= served
    return _same(wanted, reported)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool | type(None)):
        return float(a) == float(b)
    return a == b or str(a).lower() == str(b).lower()


def differences(options: Mapping[str, Any], reports: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """(each option an engine reports with another value, as `--flag job (engine url: value)`; the options no engine
    reports). `reports`: engine URL -> its /server_info."""
    differ, unreported = [], []
    for key, value in sorted(options.items()):
        name, flag = key.removeprefix(PREFIX), "--" + key.replace("_", "-")
        others = {url: info[name] for url, info in reports.items()
                  if name in info and not _serves(name, value, info[name])}
        if others:
            differ.append(f"{flag} {value} (" + ", ".join(f"{url}: {v}" for url, v in sorted(others.items())) + ")")
        elif reports and not any(name in info for info in reports.values()):
            unreported.append(flag)
    return differ, unreported


async def serving_reports(pool) -> dict[str, dict[str, Any]]:
    """/server_info of each serving engine of `pool` (one that does not answer is left out: its health check will
    replace it)."""
    serving = [e for e in pool.records.values() if e.state == EngineState.SERVING]
    replies = await asyncio.gather(*(pool.engines.server_info(e.url, timeout_s=10.0) for e in serving),
                                   return_exceptions=True)
    out = {}
    for e, reply in zip(serving, replies, strict=True):
        if isinstance(reply, PhysarumError):
            log.warning("engine %s: no /server_info to check the job's options against: %s", e.url, reply)
        elif isinstance(reply, BaseException):
            raise reply
        else:
            out[e.url] = reply
    return out


async def apply_job_options(pool, job_id: str, options: Mapping[str, Any], timeout_s: float) -> list[str]:
    """Make the pool's engines run with the job's server options: nothing to do when they already report them, a
    relaunch when the pool launches its engines with options, else FailedPrecondition naming each flag. Returns notes
    on the options no engine reports."""
    if not options:
        return []
    differ, unreported = differences(options, await serving_reports(pool))
    notes = [f"{flag}: not an option of the pool's engines (their /server_info does not report it); not applied"
             for flag in unreported]
    if not differ:
        return notes
    if not pool.takes_engine_options:
        raise FailedPrecondition(
            f"job {job_id}: its engine options disagree with the engine pool, whose engines it did not launch: "
            f"{'; '.join(differ)}; set them on the rollout service (--sglang-args, Helm engines.sglang.extraArgs) "
            f"or drop them from the job")
    # only what the engines report: an option they do not know would fail their start (a CPU engine's pod, say)
    applicable = {k: v for k, v in options.items() if "--" + k.replace("_", "-") not in unreported}
    await pool.relaunch(applicable, f"job {job_id}: {'; '.join(differ)}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        reports = await serving_reports(pool)
        if len(reports) >= max(pool.desired, 1) and not differences(options, reports)[0]:
            log.info("job %s: the engines run with its options %s", job_id, dict(options))
            return notes
    raise Unavailable(f"job {job_id}: the engines were relaunched with its options but do not serve with them "
                      f"after {timeout_s:.0f} s: {'; '.join(differ)}")
