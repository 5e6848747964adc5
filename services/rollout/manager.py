"""The generation loop: lease prompts from the buffer, fan each out to n samples through the router, score them
through reward, write each group back (idempotent by group id). It knows nothing of gRPC or of the engine pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from services.common.errors import FailedPrecondition, InvalidArgument, PhysarumError, Unavailable
from services.common.samples import Prompt, Sample, SampleGroup, Status, group_id_for
from services.rollout.client import RolloutConfig, RolloutState, RolloutStatus
from services.rollout.prompts import PromptEncoder

if TYPE_CHECKING:
    from services.buffer.client import BufferClient
    from services.reward.client import RewardClient

log = logging.getLogger(__name__)

MAX_ROUNDS_WITHOUT_PROGRESS = 3  # lease rounds in a row that write no group before the rollout fails
EMPTY_LEASE_POLL_S = 0.5
MAX_FINISHED_RUNS = 256


class _RetryableError(Exception):
    """A /generate attempt that may succeed on another try (engine restarting, request aborted)."""


@dataclass
class _Run:
    """One rollout (job_id, rollout_id) this process started, with its running statistics."""

    config: RolloutConfig
    rollout_id: int
    weight_version: str
    encoder: PromptEncoder
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    state: RolloutState = RolloutState.RUNNING
    num_groups_done: int = 0
    error: str = ""
    leased: dict[str, Prompt] = field(default_factory=dict)  # lease_id -> prompt not yet written
    num_samples: int = 0
    reward_sum: float = 0.0
    response_len_sum: int = 0
    num_truncated: int = 0
    task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"rollout {self.rollout_id} of job {self.config.job_id}"

    def record(self, samples: list[Sample]) -> None:
        self.num_samples += len(samples)
        self.reward_sum += sum(s.reward for s in samples)
        self.response_len_sum += sum(s.response_length for s in samples)
        self.num_truncated += sum(s.status == Status.TRUNCATED for s in samples)

    def metrics(self) -> dict[str, float]:
        if not self.num_samples:
            return {}
        elapsed_s = max((self.finished_at or time.monotonic()) - self.started_at, 1e-9)
        return {"rollout/reward_mean": self.reward_sum / self.num_samples,
                "rollout/response_len_mean": self.response_len_sum / self.num_samples,
                "rollout/truncated_ratio": self.num_truncated / self.num_samples,
                "rollout/samples_per_second": self.num_samples / elapsed_s}


class RolloutManager:
    """Runs rollouts as background asyncio tasks; `start_rollout` is idempotent per (job_id, rollout_id)."""

    def __init__(self, buffer: BufferClient, reward: RewardClient, router_url: str, *, model_path: str = "",
                 request_timeout_s: float = 120.0, max_generate_attempts: int = 5, retry_delay_s: float = 1.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.buffer = buffer
        self.reward = reward
        self.router_url = router_url.rstrip("/")
        self.model_path = model_path
        self.max_generate_attempts = max_generate_attempts
        self.retry_delay_s = retry_delay_s
        self.http = httpx.AsyncClient(base_url=self.router_url, timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                                      transport=transport)
        self.encoders: dict[str, PromptEncoder] = {}
        self.runs: dict[tuple[str, int], _Run] = {}

    def _encoder(self, config: RolloutConfig) -> PromptEncoder:
        path = config.tokenizer_path or self.model_path
        if not path:
            raise InvalidArgument(f"job {config.job_id}: tokenizer_path is empty and the manager has no --model-path")
        if path not in self.encoders:
            self.encoders[path] = PromptEncoder(path)
        return self.encoders[path]

    def start_rollout(self, config: RolloutConfig, rollout_id: int, weight_version: str) -> bool:
        """Start the rollout in the background unless it is running or done; returns already_running."""
        key = (config.job_id, rollout_id)
        run = self.runs.get(key)
        if run is not None and run.state in (RolloutState.RUNNING, RolloutState.DONE):
            return True
        run = _Run(config=config, rollout_id=rollout_id, weight_version=weight_version, encoder=self._encoder(config))
        self._forget_finished()
        self.runs[key] = run
        run.task = asyncio.get_running_loop().create_task(self._run(run), name=run.name)
        log.info("%s started: %d groups of %d, weight version %s, %s", run.name, config.rollout_batch_size,
                 config.n_samples_per_prompt, weight_version, config.loss_type)
        return False

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

    async def _run(self, run: _Run) -> None:
        config = run.config
        try:
            rounds_without_progress, empty_since = 0, None
            while True:
                run.num_groups_done = await asyncio.to_thread(self.buffer.count_groups, config.job_id, run.rollout_id)
                needed = config.rollout_batch_size - run.num_groups_done
                if needed <= 0:
                    break
                prompts = await asyncio.to_thread(self.buffer.lease_prompts, config.job_id, run.rollout_id, needed,
                                                  config.lease_timeout_s)
                if not prompts:  # every prompt is leased, e.g. by a manager that died: wait for its leases to expire
                    empty_since = empty_since or time.monotonic()
                    if time.monotonic() - empty_since > config.lease_timeout_s + 30:
                        raise FailedPrecondition(f"{run.name}: the buffer had no prompt to lease for "
                                                 f"{config.lease_timeout_s + 30:.0f} s")
                    await asyncio.sleep(EMPTY_LEASE_POLL_S)
                    continue
                empty_since = None
                run.leased.update((p.lease_id, p) for p in prompts)
                results = await asyncio.gather(*(self._group(run, p) for p in prompts), return_exceptions=True)
                failed = [(p, err) for p, err in zip(prompts, results, strict=True) if isinstance(err, BaseException)]
                if not failed:
                    rounds_without_progress = 0
                    continue
                await self._return_leases(run, [p.lease_id for p, _ in failed])
                for prompt, err in failed:
                    log.warning("%s: prompt %d (epoch %d) failed, lease returned: %s", run.name, prompt.index,
                                prompt.epoch, err)
                    if isinstance(err, InvalidArgument):
                        raise err
                rounds_without_progress = rounds_without_progress + 1 if len(failed) == len(prompts) else 0
                if rounds_without_progress >= MAX_ROUNDS_WITHOUT_PROGRESS:
                    raise Unavailable(f"{run.name}: {rounds_without_progress} lease rounds in a row wrote no group; "
                                      f"last error: {failed[-1][1]}")
            run.state = RolloutState.DONE
            log.info("%s done: %d groups; %s", run.name, run.num_groups_done, run.metrics())
        except asyncio.CancelledError:
            run.state, run.error = RolloutState.FAILED, f"{run.name}: cancelled (the manager is stopping)"
            raise
        except Exception as err:  # noqa: BLE001 - reported through status(), the service stays up
            run.state, run.error = RolloutState.FAILED, str(err) if isinstance(err, PhysarumError) else repr(err)
            log.error("%s failed: %s", run.name, run.error, exc_info=not isinstance(err, PhysarumError))
        finally:
            run.finished_at = time.monotonic()

    async def _return_leases(self, run: _Run, lease_ids: list[str]) -> None:
        """Give prompts back at once; if the buffer cannot be reached they come back when their lease expires."""
        for lease_id in lease_ids:
            run.leased.pop(lease_id, None)
        if not lease_ids:
            return
        try:
            await asyncio.to_thread(self.buffer.return_prompts, run.config.job_id, lease_ids)
        except PhysarumError as err:
            log.warning("%s: could not return %d leases (they expire after %s s): %s", run.name, len(lease_ids),
                        run.config.lease_timeout_s, err)

    async def _group(self, run: _Run, prompt: Prompt) -> None:
        """Generate (or, for sft_loss, build) the group answering one prompt, score it and write it."""
        config = run.config
        text, prompt_ids = run.encoder.encode(prompt)
        if config.loss_type == "sft_loss":
            samples = [self._sft_sample(run, prompt, text, prompt_ids, j) for j in range(config.n_samples_per_prompt)]
        else:
            try:
                async with asyncio.TaskGroup() as tasks:
                    pending = [tasks.create_task(self._generate(run, prompt, text, prompt_ids, j))
                               for j in range(config.n_samples_per_prompt)]
            except ExceptionGroup as group_err:
                raise group_err.exceptions[0] from None
            samples = [task.result() for task in pending]
            await self._score(run, samples)
        group = SampleGroup(group_id=group_id_for(config.job_id, prompt.epoch, prompt.index), job_id=config.job_id,
                            rollout_id=run.rollout_id, prompt_index=prompt.index, epoch=prompt.epoch, samples=samples,
                            lease_id=prompt.lease_id)
        result = await asyncio.to_thread(self.buffer.put_groups, [group])
        run.leased.pop(prompt.lease_id, None)
        if result.num_written:
            run.record(samples)
        else:
            log.warning("%s: group %s was already in the buffer", run.name, group.group_id)

    def _new_sample(self, run: _Run, prompt: Prompt, text: str, j: int) -> Sample:
        return Sample(prompt=text, prompt_messages=prompt.messages, label=prompt.label, metadata=dict(prompt.metadata),
                      group_index=prompt.index, index=j)

    def _sft_sample(self, run: _Run, prompt: Prompt, text: str, prompt_ids: list[int], j: int) -> Sample:
        """slime's sft rollout: the response is the label's tokens + eos; no generation, no reward."""
        if not prompt.label:
            raise InvalidArgument(f"{run.name}: sft_loss needs a label, prompt {prompt.index} has none "
                                  f"(load the dataset with label_key)")
        eos = [] if run.encoder.eos_token_id is None else [run.encoder.eos_token_id]
        response_ids = run.encoder.encode_text(prompt.label) + eos
        sample = self._new_sample(run, prompt, text, j)
        sample.tokens = prompt_ids + response_ids
        sample.response, sample.response_length = prompt.label, len(response_ids)
        sample.loss_mask, sample.rollout_log_probs = [1] * len(response_ids), [0.0] * len(response_ids)
        sample.status, sample.weight_versions = Status.COMPLETED, [run.weight_version]
        return sample

    def _payload(self, run: _Run, prompt_ids: list[int], rid: str) -> dict:
        """The /generate body slime sends (reference/slime.md §3.1), keys the router passes through."""
        config = run.config
        return {"input_ids": prompt_ids, "return_logprob": True, "rid": rid, "sampling_params": {
            "temperature": config.rollout_temperature, "top_p": config.rollout_top_p,
            "top_k": config.rollout_top_k if config.rollout_top_k > 0 else -1,
            "max_new_tokens": config.rollout_max_response_len, "stop": list(config.rollout_stop),
            "stop_token_ids": list(config.rollout_stop_token_ids), "no_stop_trim": True,
            "skip_special_tokens": True}}

    async def _generate(self, run: _Run, prompt: Prompt, text: str, prompt_ids: list[int], j: int) -> Sample:
        """One sample through the router, retried (bounded) while engines restart or abort requests."""
        what = f"{run.name}: prompt {prompt.index} sample {j}"
        rid_prefix = f"{run.config.job_id}-{run.rollout_id}-{prompt.epoch}-{prompt.index}-{j}-{uuid.uuid4().hex[:8]}"
        last_error = ""
        for attempt in range(1, self.max_generate_attempts + 1):
            try:
                payload = self._payload(run, prompt_ids, f"{rid_prefix}-{attempt}")
                reply = await self.http.post("/generate", json=payload)
                if 400 <= reply.status_code < 500:
                    raise InvalidArgument(f"{what}: router {self.router_url} rejected /generate: "
                                          f"HTTP {reply.status_code}: {reply.text[:500]}")
                if reply.status_code >= 500:
                    raise _RetryableError(f"HTTP {reply.status_code}: {reply.text[:300]}")
                return self._sample_from_reply(run, prompt, text, prompt_ids, j, reply.json())
            except (httpx.TransportError, _RetryableError) as err:
                last_error = f"{type(err).__name__}: {err}"
            delay_s = min(self.retry_delay_s * 2 ** (attempt - 1), 8.0)
            if attempt < self.max_generate_attempts:
                log.warning("%s: /generate attempt %d/%d failed (%s); retry in %.1f s", what, attempt,
                            self.max_generate_attempts, last_error, delay_s)
                await asyncio.sleep(delay_s)
        raise Unavailable(f"{what}: /generate through router {self.router_url} failed {self.max_generate_attempts} "
                          f"times; last: {last_error}")

    def _sample_from_reply(self, run: _Run, prompt: Prompt, text: str, prompt_ids: list[int], j: int,
                           reply: dict) -> Sample:
        meta = reply["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type", "")
        if finish == "abort":
            raise _RetryableError(f"aborted by the engine: {meta['finish_reason'].get('message', '')}")
        output_ids = list(reply["output_ids"])
        log_probs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        if len(log_probs) != len(output_ids):
            raise FailedPrecondition(f"{run.name}: prompt {prompt.index} sample {j}: {len(output_ids)} output ids but "
                                     f"{len(log_probs)} output_token_logprobs")
        sample = self._new_sample(run, prompt, text, j)
        sample.tokens = prompt_ids + output_ids
        sample.response = reply.get("text") or run.encoder.decode(output_ids)
        sample.response_length, sample.loss_mask = len(output_ids), [1] * len(output_ids)
        sample.rollout_log_probs = log_probs
        sample.status = Status.from_finish_reason(finish)
        sample.weight_versions = [str(meta.get("weight_version", ""))]
        return sample

    async def _score(self, run: _Run, samples: list[Sample]) -> None:
        """Rewards from the reward service; a failed score keeps the sample with reward 0 and its reward_error."""
        config = run.config
        try:
            results = await asyncio.to_thread(
                self.reward.score, samples, rm_type=config.rm_type, custom_rm_path=config.custom_rm_path,
                reward_key=config.reward_key, timeout_s=config.reward_timeout_s, args=config.args)
        except InvalidArgument:
            raise
        except PhysarumError as err:
            log.warning("%s: scoring %d samples failed, reward 0: %s", run.name, len(samples), err)
            for sample in samples:
                sample.reward, sample.reward_error = 0.0, f"reward service: {err}"
            return
        for sample, result in zip(samples, results, strict=True):
            sample.reward = result.reward if result.ok else 0.0
            sample.reward_scores = dict(result.scores or {})
            sample.reward_error = "" if result.ok else (result.error or "scoring failed")

    async def close(self) -> None:
        """Cancel the running rollouts and give their leased prompts back (else they return when leases expire)."""
        running = [run for run in self.runs.values() if run.task is not None and not run.task.done()]
        for run in running:
            run.task.cancel()
        await asyncio.gather(*(run.task for run in running), return_exceptions=True)
        for run in running:
            await self._return_leases(run, list(run.leased))
        await self.http.aclose()
