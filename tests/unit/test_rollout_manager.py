"""RolloutManager against an in-memory buffer and reward and a mocked router (httpx.MockTransport): no sockets."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import pytest

from services.buffer.client import PutResult
from services.common.samples import Prompt, SampleGroup, Status, group_id_for
from services.reward.client import ScoreResult
from services.rollout.client import RolloutConfig, RolloutState
from services.rollout.manager import RolloutManager
from services.rollout.prompts import PromptEncoder

JOB = "job"


class FakeBuffer:
    """The buffer's lease semantics in memory: returned prompts first, then the cursor; groups by id."""

    def __init__(self, num_prompts: int) -> None:
        self.fresh = [Prompt(job_id=JOB, index=i, epoch=0, prompt=f"{i}+1=", label=str(i + 1))
                      for i in range(num_prompts)]
        self.returned: list[Prompt] = []
        self.leased: dict[str, Prompt] = {}
        self.groups: dict[str, SampleGroup] = {}
        self.num_leases = 0

    def count_groups(self, job_id: str, rollout_id: int) -> int:
        return sum(g.rollout_id == rollout_id for g in self.groups.values())

    def lease_prompts(self, job_id: str, rollout_id: int, count: int, lease_timeout_s: float) -> list[Prompt]:
        prompts = []
        while len(prompts) < count and (self.returned or self.fresh):
            prompt = (self.returned or self.fresh).pop(0)
            self.num_leases += 1
            prompt.lease_id = f"lease-{self.num_leases}"
            self.leased[prompt.lease_id] = prompt
            prompts.append(prompt)
        return prompts

    def return_prompts(self, job_id: str, lease_ids: list[str]) -> int:
        back = [self.leased.pop(i) for i in lease_ids if i in self.leased]
        self.returned.extend(back)
        return len(back)

    def put_groups(self, groups: list[SampleGroup]) -> PutResult:
        written = 0
        for group in groups:
            self.leased.pop(group.lease_id, None)
            if group.group_id not in self.groups:
                self.groups[group.group_id], written = group, written + 1
        return PutResult(num_written=written, num_duplicate=len(groups) - written)


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
    (counted over the requests for `fail_input` only, when it is set)."""

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
        meta = {"finish_reason": {"type": self.finish}, "weight_version": "v7", "prompt_tokens": len(body["input_ids"]),
                "output_token_logprobs": [[-0.5, 17, None], [-1.25, 18, None], [-0.125, 0, None]]}
        return httpx.Response(200, json={"text": "12", "output_ids": [17, 18, 0], "meta_info": meta})


@pytest.fixture
def encoder(tiny_model_dir) -> PromptEncoder:
    return PromptEncoder(tiny_model_dir)


def config(**overrides) -> RolloutConfig:
    values = dict(job_id=JOB, rollout_batch_size=3, n_samples_per_prompt=2, rollout_max_response_len=5,
                  rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=0, rollout_stop=["\n"],
                  rollout_stop_token_ids=[3], rm_type="math", lease_timeout_s=5.0, args={"k": 1})
    return RolloutConfig(**{**values, **overrides})


async def run_rollout(buffer, engine, cfg, tiny_model_dir, rollout_id: int = 0, **kwargs):
    reward = FakeReward()
    manager = RolloutManager(buffer, reward, "http://router", model_path=str(tiny_model_dir), retry_delay_s=0.0,
                             transport=httpx.MockTransport(engine), **kwargs)
    assert manager.status(JOB, rollout_id).state == RolloutState.UNKNOWN
    assert manager.start_rollout(cfg, rollout_id, "v7") is False
    assert manager.start_rollout(cfg, rollout_id, "v7") is True
    run = manager.runs[(JOB, rollout_id)]
    await asyncio.wait_for(asyncio.shield(run.task), 30)
    status = manager.status(JOB, rollout_id)
    await manager.close()
    return status, reward


def test_rollout_writes_scored_groups_built_from_engine_replies(tiny_model_dir, encoder):
    buffer, engine = FakeBuffer(5), Engine()
    status, reward = asyncio.run(run_rollout(buffer, engine, config(), tiny_model_dir))
    assert status.state == RolloutState.DONE and status.num_groups_done == 3 and status.num_groups_target == 3
    assert sorted(buffer.groups) == [group_id_for(JOB, 0, i) for i in range(3)]
    assert not buffer.leased and engine.num_calls == 6
    body = engine.bodies[0]
    assert body["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 5,
                                       "stop": ["\n"], "stop_token_ids": [3], "no_stop_trim": True,
                                       "skip_special_tokens": True}
    assert body["return_logprob"] is True and len({b["rid"] for b in engine.bodies}) == 6
    group = buffer.groups[group_id_for(JOB, 0, 1)]
    prompt_ids = encoder.encode_text("1+1=")
    assert group.rollout_id == 0 and group.prompt_index == 1 and group.lease_id
    assert [s.index for s in group.samples] == [0, 1] and {s.group_index for s in group.samples} == {1}
    sample = group.samples[0]
    assert sample.tokens == prompt_ids + [17, 18, 0] and sample.response_length == 3 and sample.prompt == "1+1="
    assert sample.rollout_log_probs == [-0.5, -1.25, -0.125] and sample.loss_mask == [1, 1, 1]
    assert sample.status == Status.COMPLETED and sample.weight_versions == ["v7"] and sample.label == "2"
    assert sample.reward == 2.0 and sample.reward_scores == {"len": 2.0} and sample.reward_error == ""
    assert reward.calls[0] == {"rm_type": "math", "custom_rm_path": "", "reward_key": "", "timeout_s": 10.0,
                               "args": {"k": 1}}
    assert set(status.metrics) == {"rollout/reward_mean", "rollout/response_len_mean", "rollout/truncated_ratio",
                                   "rollout/samples_per_second"}
    assert status.metrics["rollout/reward_mean"] == 2.0 and status.metrics["rollout/response_len_mean"] == 3.0
    assert status.metrics["rollout/truncated_ratio"] == 0.0 and status.metrics["rollout/samples_per_second"] > 0


def test_length_finish_is_truncated_and_failed_score_keeps_sample(tiny_model_dir):
    class XEngine(Engine):
        def __call__(self, request):
            reply = super().__call__(request)
            data = reply.json()
            data["text"] = "x"
            return httpx.Response(200, json=data)

    buffer = FakeBuffer(3)
    status, _ = asyncio.run(run_rollout(buffer, XEngine(finish="length"), config(), tiny_model_dir))
    samples = [s for g in buffer.groups.values() for s in g.samples]
    assert len(samples) == 6 and all(s.status == Status.TRUNCATED for s in samples)
    assert all(s.reward == 0.0 and s.reward_error == "boom" for s in samples)
    assert status.metrics["rollout/truncated_ratio"] == 1.0


def test_generation_is_retried_while_engines_restart(tiny_model_dir):
    buffer, engine = FakeBuffer(3), Engine(failures=3)
    status, _ = asyncio.run(run_rollout(buffer, engine, config(), tiny_model_dir))
    assert status.state == RolloutState.DONE and len(buffer.groups) == 3 and engine.num_calls == 9


def test_failed_group_returns_its_lease_and_rollout_leases_again(tiny_model_dir, encoder):
    # 2 attempts per sample and prompt 0's first 2 requests fail: its group fails, prompt 1's is written.
    buffer, engine = FakeBuffer(4), Engine(failures=2, fail_input=encoder.encode_text("0+1="))
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=2, n_samples_per_prompt=1),
                                        tiny_model_dir, max_generate_attempts=2))
    assert status.state == RolloutState.DONE and len(buffer.groups) == 2
    assert not buffer.leased and buffer.num_leases == 3  # the failed prompt came back and was leased again
    assert engine.num_calls == 4
    assert sorted(g.prompt_index for g in buffer.groups.values()) == [0, 1]


def test_rollout_fails_clearly_after_bounded_rounds(tiny_model_dir):
    buffer, engine = FakeBuffer(10), Engine(failures=10**6)
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=1, n_samples_per_prompt=1),
                                        tiny_model_dir, max_generate_attempts=2))
    assert status.state == RolloutState.FAILED and not buffer.groups and not buffer.leased
    assert "3 lease rounds in a row wrote no group" in status.error and "HTTP 503" in status.error
    assert engine.num_calls == 6


def test_rejected_request_fails_the_rollout_at_once(tiny_model_dir):
    buffer, engine = FakeBuffer(3), Engine(failures=1, status_code=400)
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=1, n_samples_per_prompt=1),
                                        tiny_model_dir))
    assert status.state == RolloutState.FAILED and "rejected /generate: HTTP 400" in status.error
    assert engine.num_calls == 1 and not buffer.leased and len(buffer.returned) == 1


def test_aborted_generation_is_retried(tiny_model_dir):
    class AbortOnce(Engine):
        def __call__(self, request):
            self.finish = "abort" if self.num_calls == 0 else "stop"
            return super().__call__(request)

    buffer, engine = FakeBuffer(1), AbortOnce()
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=1, n_samples_per_prompt=1),
                                        tiny_model_dir))
    assert status.state == RolloutState.DONE and engine.num_calls == 2
    assert buffer.groups[group_id_for(JOB, 0, 0)].samples[0].status == Status.COMPLETED


def test_restarted_rollout_only_tops_up_missing_groups(tiny_model_dir):
    buffer, engine = FakeBuffer(6), Engine()
    first = buffer.lease_prompts(JOB, 0, 2, 5.0)
    buffer.put_groups([SampleGroup(group_id=group_id_for(JOB, 0, p.index), job_id=JOB, rollout_id=0,
                                   prompt_index=p.index, epoch=0, samples=[], lease_id=p.lease_id) for p in first])
    status, _ = asyncio.run(run_rollout(buffer, engine, config(), tiny_model_dir))
    assert status.state == RolloutState.DONE and len(buffer.groups) == 3 and engine.num_calls == 2


def test_sft_rollout_builds_label_responses_without_generation(tiny_model_dir, encoder):
    buffer, engine = FakeBuffer(2), Engine()
    status, reward = asyncio.run(run_rollout(buffer, engine, config(loss_type="sft_loss", rollout_batch_size=2),
                                             tiny_model_dir))
    assert status.state == RolloutState.DONE and engine.num_calls == 0 and not reward.calls
    sample = buffer.groups[group_id_for(JOB, 0, 1)].samples[1]
    label_ids = encoder.encode_text("2") + [encoder.eos_token_id]
    assert sample.tokens == encoder.encode_text("1+1=") + label_ids and sample.response == "2"
    assert sample.response_length == 2 and sample.loss_mask == [1, 1] and sample.rollout_log_probs == [0.0, 0.0]
    assert sample.reward == 0.0 and sample.status == Status.COMPLETED and sample.weight_versions == ["v7"]


def test_sft_without_label_fails_naming_the_prompt(tiny_model_dir):
    buffer = FakeBuffer(1)
    buffer.fresh[0].label = ""
    status, _ = asyncio.run(run_rollout(buffer, Engine(), config(loss_type="sft_loss", rollout_batch_size=1),
                                        tiny_model_dir))
    assert status.state == RolloutState.FAILED and "prompt 0 has none" in status.error
