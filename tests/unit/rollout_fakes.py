"""In-memory stand-ins for the rollout manager's unit tests: the buffer's lease semantics, a reward service, and
scripted routers (httpx.MockTransport handlers). No sockets, no processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.buffer.client import DatasetInfo, PutResult, decode_served_group
from services.common.samples import EncodedGroup, Prompt, SampleGroup
from services.common.settings.rollout import RolloutConfig
from services.reward.client import ScoreResult
from services.rollout.client import RolloutStatus
from services.rollout.generation.manager import RolloutManager

JOB = "job"


class FakeBuffer:
    """The buffer's lease semantics in memory: returned prompts first, then the cursor; groups by id. Other jobs
    (eval datasets) load from JSONL files into their own FakeBuffer."""

    def __init__(self, num_prompts: int = 0, job_id: str = JOB, prompts: list[Prompt] | None = None) -> None:
        self.job_id = job_id
        self.fresh = prompts if prompts is not None else [
            Prompt(job_id=job_id, index=i, epoch=0, prompt=f"{i}+1=", label=str(i + 1)) for i in range(num_prompts)]
        self.num_prompts = len(self.fresh)
        self.returned: list[Prompt] = []
        self.leased: dict[str, Prompt] = {}
        self.groups: dict[str, SampleGroup] = {}
        self.num_leases = 0
        self.others: dict[str, FakeBuffer] = {}

    def _of(self, job_id: str) -> FakeBuffer:
        return self if job_id == self.job_id else self.others[job_id]

    def load_dataset(self, job_id: str, path: str, *, input_key: str = "input", label_key: str = "",
                     **_: object) -> DatasetInfo:
        if job_id in self.others:
            return DatasetInfo(num_prompts=self.others[job_id].num_prompts, num_skipped=0, errors=[],
                               already_loaded=True)
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        prompts = [Prompt(job_id=job_id, index=i, epoch=0, prompt=row[input_key], label=row.get(label_key, ""))
                   for i, row in enumerate(rows)]
        self.others[job_id] = FakeBuffer(job_id=job_id, prompts=prompts)
        return DatasetInfo(num_prompts=len(prompts), num_skipped=0, errors=[], already_loaded=False)

    def count_groups(self, job_id: str, rollout_id: int) -> int:
        return sum(g.rollout_id == rollout_id for g in self._of(job_id).groups.values())

    def lease_prompts(self, job_id: str, rollout_id: int, count: int, lease_timeout_s: float) -> list[Prompt]:
        buffer = self._of(job_id)
        prompts = []
        while len(prompts) < count and (buffer.returned or buffer.fresh):
            prompt = (buffer.returned or buffer.fresh).pop(0)
            buffer.num_leases += 1
            prompt.lease_id = f"lease-{buffer.num_leases}"
            buffer.leased[prompt.lease_id] = prompt
            prompts.append(prompt)
        return prompts

    def return_prompts(self, job_id: str, lease_ids: list[str]) -> int:
        buffer = self._of(job_id)
        back = [buffer.leased.pop(i) for i in lease_ids if i in buffer.leased]
        buffer.returned.extend(back)
        return len(back)

    def put_groups(self, groups: list[SampleGroup] | list[EncodedGroup]) -> PutResult:
        """Stores each group as a reader of the buffer gets it back (an encoded one decoded from its bytes)."""
        written = 0
        for group in groups:
            if isinstance(group, EncodedGroup):
                group = decode_served_group(group.payload, group.rollout_id)
            self.leased.pop(group.lease_id, None)
            if group.group_id not in self.groups:
                self.groups[group.group_id], written = group, written + 1
        return PutResult(num_written=written, num_duplicate=len(groups) - written)

    def rollout_groups(self, rollout_id: int) -> list[SampleGroup]:
        return sorted((g for g in self.groups.values() if g.rollout_id == rollout_id), key=lambda g: g.prompt_index)


class FakeReward:
    """reward = number of response characters; a sample whose response is "x" fails to score."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def score(self, samples, **kwargs) -> list[ScoreResult]:
        self.calls.append(kwargs)
        return [ScoreResult(reward=0.0, ok=False, error="boom") if s.response == "x"
                else ScoreResult(reward=float(len(s.response)), ok=True, scores={"len": float(len(s.response))})
                for s in samples]


@dataclass
class Engine:
    """The router's /generate: replies "12" + eos (ids 17, 18, 0) with fixed logprobs, after `failures` errors
    (counted over the requests for `fail_input` only, when it is set); a batch of input_ids gets a list."""

    failures: int = 0
    status_code: int = 503
    finish: str = "stop"
    fail_input: list[int] | None = None
    num_calls: int = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.num_calls += 1
        body = json.loads(request.content)
        self.bodies = getattr(self, "bodies", []) + [body]
        if self.failures > 0 and self.fail_input in (None, body["input_ids"]):
            self.failures -= 1
            return httpx.Response(self.status_code, text="no healthy workers")
        batch = body["input_ids"] if body["input_ids"] and isinstance(body["input_ids"][0], list) else None
        replies = [self.reply(ids) for ids in (batch or [body["input_ids"]])]
        return httpx.Response(200, json=replies if batch is not None else replies[0])

    def reply(self, input_ids: list[int]) -> dict:
        meta = {"finish_reason": {"type": self.finish}, "weight_version": "v7", "prompt_tokens": len(input_ids),
                "output_token_logprobs": [[-0.5, 17, None], [-1.25, 18, None], [-0.125, 0, None]]}
        return {"text": "12", "output_ids": [17, 18, 0], "meta_info": meta}


def reply(token_ids: list[int], text: str, *, finish: str = "stop", weight_version: str = "v1",
          logprob: float = -0.5, matched: object = None) -> dict:
    """An SGLang /generate reply with one log-prob per token (logprob, logprob - 1, ...)."""
    entries = [[logprob - i, t, None] for i, t in enumerate(token_ids)]
    reason = {"type": finish} if matched is None else {"type": finish, "matched": matched}
    return {"text": text, "output_ids": list(token_ids),
            "meta_info": {"finish_reason": reason, "weight_version": weight_version,
                          "output_token_logprobs": entries}}


@dataclass
class ScriptedRouter:
    """A router and its engines behind an async MockTransport handler.

    `script(body, headers) -> dict | None` answers /generate at once; None holds the request until an engine is
    told /abort_request, and it is then answered by `on_abort(body)`. GET /workers lists `workers`; every
    /abort_request is recorded with its URL.
    """

    script: Callable[[dict, httpx.Headers], dict | None]
    on_abort: Callable[[dict], dict] = lambda body: reply([], "", finish="abort")
    workers: tuple[str, ...] = ("http://engine-1", "http://engine-2")
    requests: list[tuple[dict, httpx.Headers]] = field(default_factory=list)
    aborts: list[tuple[str, dict]] = field(default_factory=list)
    num_held: int = 0

    def __post_init__(self) -> None:
        self.aborted = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if request.method == "GET" and url.endswith("/workers"):
            return httpx.Response(200, json={"workers": [{"id": f"w{i}", "url": u}
                                                         for i, u in enumerate(self.workers)]})
        if url.endswith("/abort_request"):
            self.aborts.append((url, json.loads(request.content)))
            self.aborted.set()
            return httpx.Response(200)
        body = json.loads(request.content)
        self.requests.append((body, request.headers))
        answer = self.script(body, request.headers)
        if answer is None:
            self.num_held += 1
            await self.aborted.wait()
            answer = self.on_abort(body)
        return httpx.Response(200, json=answer)


def rollout_config(**overrides) -> RolloutConfig:
    values = dict(job_id=JOB, rollout_batch_size=3, n_samples_per_prompt=2, rollout_max_response_len=5,
                  rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=0, rollout_stop=["\n"],
                  rollout_stop_token_ids=[3], rm_type="math", lease_timeout_s=5.0, args={"k": 1})
    return RolloutConfig(**{**values, **overrides})


def new_manager(buffer: FakeBuffer, handler: Callable, model_dir, **kwargs) -> tuple[RolloutManager, FakeReward]:
    reward = FakeReward()
    kwargs.setdefault("batch_groups", False)  # the scripts answer one sample per request (see test_rollout_batched)
    manager = RolloutManager(buffer, reward, "http://router", model_path=str(model_dir), retry_delay_s=0.0,
                             transport=httpx.MockTransport(handler), **kwargs)
    return manager, reward


async def rollout(manager: RolloutManager, config: RolloutConfig, rollout_id: int, weight_version: str = "v1",
                  timeout_s: float = 30.0) -> RolloutStatus:
    """Start a rollout and wait for it to end."""
    manager.start_rollout(config, rollout_id, weight_version)
    await asyncio.wait_for(asyncio.shield(manager.runs[(config.job_id, rollout_id)].task), timeout_s)
    return manager.status(config.job_id, rollout_id)


def sample_of(body: dict) -> tuple[int, int]:
    """(prompt index, sample index) from a request's rid "<job>-<rollout>-<prompt>-<sample>-<random>"."""
    parts = body["rid"].split("-")
    return int(parts[-3]), int(parts[-2])
