"""The generation loop (slime's generate_rollout_async): lease prompts from the buffer, generate each group through the
router, score it, filter it, write it back (idempotent by group id). It over-samples, aborts the surplus once the batch
is full and, with partial rollout, keeps the drained groups for a later rollout; it also runs evals (RunEval).
It knows nothing of gRPC or of the engine pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx

from services.buffer.client import STREAM_ROLLOUT_ID
from services.common.errors import FailedPrecondition, InvalidArgument, PhysarumError, Unavailable
from services.common.samples import Prompt, Sample, SampleGroup, Status, encode_group, group_id_for
from services.common.settings.rollout import RolloutConfig
from services.common.sglang import lora_adapter_name
from services.rollout.client import RolloutState, RolloutStatus
from services.rollout.engine_calls.generate import STICKY_POLICIES
from services.rollout.engine_calls.router_http import AiohttpPoster, HttpxPoster, Poster
from services.rollout.generation import engine_weights, filters, rollout_function
from services.rollout.generation.agents import AgentGateway
from services.rollout.generation.drain import EngineAborter, drain_surplus
from services.rollout.generation.evaluation import eval_groups, run_eval
from services.rollout.generation.groups import (
    Generation,
    generate_group,
    new_generation,
    new_sample,
    rate_group,
    sft_sample,
)
from services.rollout.generation.partial import PartialGroups, prepare_resumed
from services.rollout.generation.prompts import PromptEncoder
from services.rollout.generation.run_state import Run

if TYPE_CHECKING:
    from services.buffer.client import BufferClient
    from services.reward.client import RewardClient

log = logging.getLogger(__name__)

MAX_ROUNDS_WITHOUT_PROGRESS = 3  # groups failing in a row, per group of the batch, before the rollout fails
MAX_DROPS_PER_GROUP = 20  # groups the dynamic filter drops in a row, per group of the batch, before it fails
DROPPED_ROLLOUT_ID = -1  # dropped groups are stored here: their prompts are used up for the epoch, as in slime
EMPTY_LEASE_POLL_S = 0.5
MAX_FINISHED_RUNS = 256
MAX_CONCURRENT_REQUESTS = 256  # /generate requests in flight (and kept-alive connections to the router)


class RolloutManager:
    """Runs rollouts as background asyncio tasks; `start_rollout` is idempotent per (job_id, rollout_id), and so is
    `run_eval`."""

    def __init__(self, buffer: BufferClient, reward: RewardClient, router_url: str, *, model_path: str = "",
                 router_policy: str = "round_robin", request_timeout_s: float = 120.0, max_generate_attempts: int = 5,
                 retry_delay_s: float = 1.0, transport: httpx.AsyncBaseTransport | None = None,
                 version_now: Callable[[], str | None] | None = None, batch_groups: bool = True,
                 gateway: AgentGateway | None = None,
                 adapter_version_now: Callable[[str], str | None] | None = None) -> None:
        self.buffer = buffer
        self.gateway = gateway  # serves the sessions of agent_function_path jobs
        self.version_now = version_now  # the pool's settled weight version, recorded with each request
        # a LoRA adapter's own (by name): the version a LoRA job's requests record and its rollouts wait for
        self.adapter_version_now = adapter_version_now
        self.reward = reward
        self.router_url = router_url.rstrip("/")
        self.model_path = model_path
        self.sticky_routing = router_policy in STICKY_POLICIES
        self.max_generate_attempts = max_generate_attempts
        self.retry_delay_s = retry_delay_s
        # a group's fresh samples in one /generate: 8x fewer requests for the manager, the router and the engines
        self.batch_groups = batch_groups
        # aiohttp with kept-alive connections (router_http.py says why not httpx); a scripted transport in tests
        self.http: Poster = (AiohttpPoster(MAX_CONCURRENT_REQUESTS, request_timeout_s) if transport is None else
                             HttpxPoster(httpx.AsyncClient(timeout=request_timeout_s, transport=transport)))
        self.aborter = EngineAborter(self.router_url, transport=transport)
        self.slots = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)
        self.encoders: dict[str, PromptEncoder] = {}
        self.runs: dict[tuple[str, int], Run] = {}
        self.evals: dict[tuple[str, int], asyncio.Task] = {}
        self.partial = PartialGroups()
        self.sources: dict[str, rollout_function.JobSource] = {}  # rollout_function_path jobs' data sources

    def _encoder(self, config: RolloutConfig) -> PromptEncoder:
        path = config.tokenizer_path or self.model_path
        if not path:
            raise InvalidArgument(f"job {config.job_id}: tokenizer_path is empty and the manager has no --model-path")
        if path not in self.encoders:
            self.encoders[path] = PromptEncoder(path)
        return self.encoders[path]

    def _generation(self, config: RolloutConfig, rollout_id: int, evaluation: bool) -> Generation:
        return new_generation(config, self._encoder(config), self.reward, rollout_id, evaluation=evaluation,
                              http=self.http, router_url=self.router_url, sticky_routing=self.sticky_routing,
                              max_attempts=self.max_generate_attempts, retry_delay_s=self.retry_delay_s,
                              slots=self.slots, version_now=self._version_now(config),
                              batch_groups=self.batch_groups, gateway=self.gateway)

    def _version_now(self, config: RolloutConfig) -> Callable[[], str | None] | None:
        """The engines' version a job's requests are made with: its adapter's for a LoRA job (the jobs sharing the
        pool each version their own), the pool's otherwise."""
        if config.args.get("lora_rank") and self.adapter_version_now is not None:
            return functools.partial(self.adapter_version_now, lora_adapter_name(config.job_id))
        return self.version_now

    def _filter(self, config: RolloutConfig) -> Callable[..., Any] | None:
        if not config.dynamic_sampling_filter_path:
            return None
        fn = filters.load_filter(config.dynamic_sampling_filter_path)
        if fn in filters.BUILTINS.values() and config.n_samples_per_prompt < 2:
            raise InvalidArgument(f"job {config.job_id}: dynamic_sampling_filter_path {fn.__name__} drops every group "
                                  f"of one sample; set n_samples_per_prompt >= 2")
        return fn

    def start_rollout(self, config: RolloutConfig, rollout_id: int, weight_version: str) -> bool:
        """Start the rollout in the background unless it is running or done; returns already_running."""
        key = (config.job_id, rollout_id)
        stream = config.max_inflight_groups > 0
        if stream != (rollout_id == STREAM_ROLLOUT_ID):
            raise InvalidArgument(f"job {config.job_id}: rollout {rollout_id}: a fully_async stream (max_inflight_"
                                  f"groups > 0) is rollout {STREAM_ROLLOUT_ID}, and rollout {STREAM_ROLLOUT_ID} is a "
                                  "stream")
        run = self.runs.get(key)
        if run is not None and (run.state == RolloutState.RUNNING or (run.state == RolloutState.DONE and not stream)):
            return True  # a stopped stream starts again (its trainer resumed)
        run = Run(gen=self._generation(config, rollout_id, evaluation=False), rollout_id=rollout_id,
                   weight_version=weight_version, filter_fn=self._filter(config))
        self._forget_finished()
        self.runs[key] = run
        body = self._stream(run) if stream else self._run_function(run) if config.uses_data_source else \
            self._run(run)
        run.task = asyncio.get_running_loop().create_task(body, name=run.name)
        log.info("%s started: %d groups of %d (over-sampling %d), weight version %s, %s", run.name,
                 config.rollout_batch_size, config.n_samples_per_prompt, config.over_sampling_batch_size,
                 weight_version, config.loss_type)
        return False

    async def stop_rollout(self, job_id: str, rollout_id: int) -> RolloutStatus:
        """Cancel a running rollout (a fully_async stream ends this way); its leases go back to the buffer."""
        run = self.runs.get((job_id, rollout_id))
        if run is not None and run.task is not None and not run.task.done():
            run.stopping = True
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
        return self.status(job_id, rollout_id)

    def status(self, job_id: str, rollout_id: int) -> RolloutStatus:
        run = self.runs.get((job_id, rollout_id))
        if run is None:
            return RolloutStatus(state=RolloutState.UNKNOWN)
        return RolloutStatus(state=run.state, num_groups_done=run.num_groups_done,
                             num_groups_target=run.config.rollout_batch_size, error=run.error, metrics=run.metrics())

    def _forget_finished(self) -> None:
        finished = [key for key, run in self.runs.items() if run.state != RolloutState.RUNNING]
        for key in finished[: max(0, len(finished) - MAX_FINISHED_RUNS)]:
            del self.runs[key]

    # ----- one rollout -----

    async def _run(self, run: Run) -> None:
        config, target = run.config, run.config.rollout_batch_size
        pending: dict[asyncio.Task, Prompt] = {}
        async with self._ending(run, pending):
            await engine_weights.wait_for(run.name, run.weight_version, run.gen.ctx.version_now)
            run.num_groups_done = await asyncio.to_thread(self.buffer.count_groups, config.job_id, run.rollout_id)
            empty_since = None
            while run.num_groups_done < target:
                missing = target - run.num_groups_done - len(pending)
                if missing > 0:  # slime leases over_sampling_batch_size groups at a time; unset, the missing ones
                    await self._lease_groups(run, pending, max(missing, config.over_sampling_batch_size))
                if not pending:  # every prompt is leased, e.g. by a manager that died: wait for its leases to expire
                    empty_since = empty_since or time.monotonic()
                    if time.monotonic() - empty_since > config.lease_timeout_s + 30:
                        raise FailedPrecondition(f"{run.name}: the buffer had no prompt to lease for "
                                                 f"{config.lease_timeout_s + 30:.0f} s")
                    await asyncio.sleep(EMPTY_LEASE_POLL_S)
                    continue
                empty_since = None
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                await self._settle(run, pending, done, limit=target)
            await self._drain(run, pending)
            run.state = RolloutState.DONE
            log.info("%s done: %d groups; %s", run.name, run.num_groups_done, run.metrics())

    async def _run_function(self, run: Run) -> None:
        """rollout_function_path: the user's function makes the rollout's groups (rollout_function.py)."""
        config, give_back = run.config, functools.partial(self._return_leases, run)
        async with self._ending(run, {}), rollout_function.job_rollout(
                self.sources, config, self.buffer, self._encoder(config), run.rollout_id, give_back) as source:
            await engine_weights.wait_for(run.name, run.weight_version, run.gen.ctx.version_now)
            kept, dropped = await rollout_function.generate_groups(run, source, self.aborter)
            writes = [(p, s, run.rollout_id) for p, s in kept] + [(p, s, DROPPED_ROLLOUT_ID) for p, s in dropped]
            await self._write(run, writes)
            source.prompts.written([prompt for prompt, _, _ in writes])
            run.state = RolloutState.DONE

    async def _stream(self, run: Run) -> None:
        """fully_async: generate across rollout boundaries until StopRollout, keeping max_inflight_groups groups
        generating or written and not yet taken by the trainer (buffer TakeBatch)."""
        config = run.config
        pending: dict[asyncio.Task, Prompt] = {}
        async with self._ending(run, pending):
            await engine_weights.wait_for(run.name, run.weight_version, run.gen.ctx.version_now)
            while True:
                waiting = await asyncio.to_thread(self.buffer.count_groups, config.job_id, run.rollout_id)
                if (missing := config.max_inflight_groups - waiting - len(pending)) > 0:
                    await self._lease_groups(run, pending, missing)
                if not pending:  # the bound is reached, or every prompt is leased: look again shortly
                    await asyncio.sleep(EMPTY_LEASE_POLL_S)
                    continue
                done, _ = await asyncio.wait(pending, timeout=EMPTY_LEASE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                await self._settle(run, pending, done, limit=None)

    async def _lease_groups(self, run: Run, pending: dict[asyncio.Task, Prompt], count: int) -> None:
        """Lease up to `count` prompts and start a group task for each."""
        prompts = await asyncio.to_thread(self.buffer.lease_prompts, run.config.job_id, run.rollout_id, count,
                                          run.config.lease_timeout_s)
        for prompt in prompts:
            run.leased[prompt.lease_id] = prompt
            pending[asyncio.create_task(self._group(run, prompt))] = prompt

    @contextlib.asynccontextmanager
    async def _ending(self, run: Run, pending: dict[asyncio.Task, Prompt]) -> AsyncIterator[None]:
        """How a run ends: an error is recorded (reported through status(); the service stays up), cancellation
        goes on; either way its groups stop and its leases go back."""
        try:
            yield
        except BaseException as err:
            self._fail(run, err)
            if isinstance(err, asyncio.CancelledError):
                raise
        finally:
            await self._stop_groups(run, pending)

    def _fail(self, run: Run, err: BaseException) -> None:
        """Record how a run ended early: stopped (StopRollout), cancelled (the manager stops) or failed."""
        if isinstance(err, asyncio.CancelledError):
            run.state = RolloutState.DONE if run.stopping else RolloutState.FAILED
            run.error = "" if run.stopping else f"{run.name}: cancelled (the manager is stopping)"
            if run.stopping:
                log.info("%s stopped: %d groups; %s", run.name, run.num_groups_done, run.metrics())
        elif isinstance(err, Exception):  # reported through status(), the service stays up
            run.state, run.error = RolloutState.FAILED, str(err) if isinstance(err, PhysarumError) else repr(err)
            log.error("%s failed: %s", run.name, run.error, exc_info=not isinstance(err, PhysarumError))

    async def _stop_groups(self, run: Run, pending: dict[asyncio.Task, Prompt]) -> None:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._return_leases(run, list(run.leased))
        run.finished_at = time.monotonic()

    async def _settle(self, run: Run, pending: dict[asyncio.Task, Prompt], done: set[asyncio.Task],
                      limit: int | None) -> None:
        """Groups finished: each is kept, dropped (dynamic filter) or, if it failed, its prompt goes back; what is
        kept or dropped goes to the buffer in one call. Once `limit` groups are done the rest stays in `pending`
        (surplus, drained by the caller)."""
        writes: list[tuple[Prompt, list[Sample], int]] = []
        kept = 0  # of `writes`, the groups this rollout keeps
        for task in done:
            if limit is not None and run.num_groups_done + kept >= limit:
                break
            prompt = pending.pop(task)
            rollout_id = await self._judge(run, prompt, task, num_pending=len(pending) + kept)
            if rollout_id is not None:
                writes.append((prompt, task.result(), rollout_id))
                kept += rollout_id == run.rollout_id
        await self._write(run, writes)

    async def _judge(self, run: Run, prompt: Prompt, task: asyncio.Task, num_pending: int) -> int | None:
        """Where a finished group goes: this rollout, DROPPED_ROLLOUT_ID (dynamic filter) or, if it failed, nowhere
        (its prompt is given back). num_pending counts the groups kept or in flight besides this one."""
        config = run.config
        try:
            samples = task.result()
            if any(s.status == Status.ABORTED for s in samples):
                raise FailedPrecondition("the generate function returned an ABORTED sample (the rollout was not "
                                         "being aborted)")
        except InvalidArgument:
            raise
        except Exception as err:  # noqa: BLE001 - a failed group gives its prompt back; bounded below
            await self._return_leases(run, [prompt.lease_id])
            log.warning("%s: prompt %d (epoch %d) failed, lease returned: %s", run.name, prompt.index, prompt.epoch,
                        err)
            run.num_failed_in_a_row += 1
            limit = MAX_ROUNDS_WITHOUT_PROGRESS * max(config.rollout_batch_size, config.over_sampling_batch_size)
            if run.num_failed_in_a_row >= limit:
                raise Unavailable(f"{run.name}: {run.num_failed_in_a_row} groups in a row failed; last error: "
                                  f"{err}") from None
            return None
        run.num_failed_in_a_row = 0
        if run.filter_fn is not None:
            if run.filter_fn not in filters.BUILTINS.values():  # a user's filter may change the samples it reads
                run.encoded.pop(prompt.lease_id, None)
            output = filters.call_filter(run.filter_fn, run.gen.args, samples)
            if filters.should_drop(output, num_remaining=run.num_groups_done + num_pending + 1,
                                   target=config.rollout_batch_size):
                run.drops[filters.drop_metric(output.reason)] += 1
                run.num_dropped_in_a_row += 1
                if run.num_dropped_in_a_row >= MAX_DROPS_PER_GROUP * config.rollout_batch_size:
                    raise FailedPrecondition(f"{run.name}: dynamic_sampling_filter_path "
                                             f"{config.dynamic_sampling_filter_path} dropped "
                                             f"{run.num_dropped_in_a_row} groups in a row ({dict(run.drops)})")
                return DROPPED_ROLLOUT_ID
        run.num_dropped_in_a_row = 0
        return run.rollout_id

    async def _write(self, run: Run, writes: list[tuple[Prompt, list[Sample], int]]) -> None:
        """Store the groups in one PutGroups (acking their leases) and count the ones kept."""
        if not writes:
            return
        job = run.config.job_id
        groups = [encode_group(SampleGroup(group_id=group_id_for(job, prompt.epoch, prompt.index), job_id=job,
                                           rollout_id=rollout_id, prompt_index=prompt.index, epoch=prompt.epoch,
                                           samples=samples, lease_id=prompt.lease_id, images=prompt.images),
                               run.encoded.pop(prompt.lease_id, ()))
                  for prompt, samples, rollout_id in writes]
        result = await asyncio.to_thread(self.buffer.put_groups, groups)
        for prompt, _, _ in writes:
            run.leased.pop(prompt.lease_id, None)
        kept = [samples for _, samples, rollout_id in writes if rollout_id == run.rollout_id]
        if not result.num_duplicate:
            run.num_groups_done += len(kept)
            for samples in kept:
                run.record(samples)
            return
        # Some were stored already, maybe by this very write: PutGroups retried after its reply was lost (the buffer
        # or Redis died) finds its own groups. The statistics leave this write out (which groups were new is not
        # known); the count comes from the buffer, or the rollout gets groups more than its batch, which no one
        # trains and no one generates again. A stream counts the fewest the write can have kept.
        log.warning("%s: %d of %d groups were already in the buffer", run.name, result.num_duplicate, len(groups))
        if run.rollout_id == STREAM_ROLLOUT_ID:
            run.num_groups_done += max(0, result.num_written - (len(groups) - len(kept)))
        else:
            run.num_groups_done = await asyncio.to_thread(self.buffer.count_groups, job, run.rollout_id)

    async def _drain(self, run: Run, pending: dict[asyncio.Task, Prompt]) -> None:
        """The batch is full: stop the surplus groups (drain.py) and give their prompts back."""
        if not pending:
            return
        await drain_surplus(run.gen, run.rollout_id, pending, self.aborter, self.partial)
        await self._return_leases(run, [prompt.lease_id for prompt in pending.values()])

    async def _return_leases(self, run: Run, lease_ids: list[str]) -> None:
        """Give prompts back at once; if the buffer cannot be reached they come back when their lease expires."""
        for lease_id in lease_ids:
            run.leased.pop(lease_id, None)
            run.encoded.pop(lease_id, None)
        if not lease_ids:
            return
        try:
            await asyncio.to_thread(self.buffer.return_prompts, run.config.job_id, lease_ids)
        except PhysarumError as err:
            log.warning("%s: could not return %d leases (they expire after %s s): %s", run.name, len(lease_ids),
                        run.config.lease_timeout_s, err)

    # ----- one group -----

    async def _group(self, run: Run, prompt: Prompt) -> list[Sample]:
        """The scored group answering one prompt (for sft_loss: built from the label). A group the manager is
        aborting comes back unscored, with what it generated."""
        config, gen = run.config, run.gen
        text, prompt_ids = gen.encoder.encode(prompt)
        if config.loss_type == "sft_loss":
            return [sft_sample(gen.encoder, prompt, text, prompt_ids, j, run.weight_version, run.name,
                               config.loss_mask_type)
                    for j in range(config.n_samples_per_prompt)]
        samples = self.partial.take(config.job_id, prompt, text) if config.partial_rollout else None
        if samples is not None:
            prepare_resumed(samples, config.mask_offpolicy_in_partial_rollout)
        else:
            samples = [new_sample(prompt, text, prompt_ids, j) for j in range(gen.n_samples)]
        samples = await generate_group(gen, samples)
        if gen.ctx.aborting or any(s.status == Status.ABORTED for s in samples):
            return samples
        run.encoded[prompt.lease_id] = await rate_group(gen, samples, f"{run.name}: prompt {prompt.index}")
        return samples

    # ----- eval -----

    async def run_eval(self, config: RolloutConfig, rollout_id: int, weight_version: str) -> dict[str, float]:
        """Generate and score n_samples_per_eval_prompt samples for every prompt of every eval dataset; a repeated
        call joins the eval already running (or returns its result); a failed eval runs again."""
        key = (config.job_id, rollout_id)
        task = self.evals.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            gens = {name: self._generation(config.for_eval_dataset(name), rollout_id, evaluation=True)
                    for name in config.eval_datasets}
            body = self._function_eval(config, gens, rollout_id) if (
                config.eval_function_path or config.rollout_function_path) else run_eval(self.buffer, gens,
                                                                                          rollout_id)
            task = asyncio.get_running_loop().create_task(body, name=f"eval at rollout {rollout_id} of job "
                                                                     f"{config.job_id}")
            self.evals[key] = task
            for old in list(self.evals)[: max(0, len(self.evals) - MAX_FINISHED_RUNS)]:
                if self.evals[old].done():
                    del self.evals[old]
        return await asyncio.shield(task)

    async def _function_eval(self, config: RolloutConfig, gens: dict[str, Generation],
                             rollout_id: int) -> dict[str, float]:
        """slime's eval function (eval_function_path, else the rollout function) on the job's data source."""
        source = rollout_function.job_source(self.sources, config, self.buffer, self._encoder(config))
        metrics = await rollout_function.evaluate(
            source, self._generation(config, rollout_id, evaluation=True), gens, rollout_id, self.aborter,
            lambda: eval_groups(self.buffer, gens, rollout_id))
        log.info("eval at rollout %d of job %s (eval function): %s", rollout_id, config.job_id, metrics)
        return metrics

    async def close(self) -> None:
        """Cancel the running rollouts and evals; rollouts give their leased prompts back as they stop."""
        running = [run.task for run in self.runs.values() if run.task is not None and not run.task.done()]
        running += [task for task in self.evals.values() if not task.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for run in self.runs.values():
            await self._return_leases(run, list(run.leased))
        await asyncio.gather(self.http.aclose(), self.aborter.close())
