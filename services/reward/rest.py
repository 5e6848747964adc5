"""The Reward service's REST API (FastAPI): POST /v1/score, GET /healthz, GET /metrics, OpenAPI at /docs."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from services.common import auth
from services.common.rest import create_rest_app
from services.common.samples import Sample
from services.reward.config import RewardConfig
from services.reward.metrics import RewardMetrics
from services.reward.workers import WorkerPool


class SampleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = ""
    response: str = ""
    label: Any = ""  # slime keeps a label's JSON type
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rm_type: str = Field("", description="built-in scorer: one of slime's rm types (math, deepscaler, dapo, f1, gpqa, "
                                              "remote_rm, random; boxed_ prefix) or exact_match")
    custom_rm_path: str = Field("", description="'pkg.mod.fn', slime's `async def f(args, sample)`; wins over rm_type")
    reward_key: str = Field("", description="picks the reward when a scorer returns a dict")
    timeout_s: float | None = Field(None, gt=0, description="per-sample timeout (default: the service's)")
    samples: list[SampleIn]
    args: dict[str, Any] = Field(default_factory=dict, description="handed to custom_rm_path functions as `args`")


class ScoreOut(BaseModel):
    reward: float
    ok: bool
    error: str
    scores: dict[str, float]


class ScoreResponse(BaseModel):
    scores: list[ScoreOut]


def create_app(config: RewardConfig, semaphore: asyncio.Semaphore, pool: WorkerPool,
               metrics: RewardMetrics) -> FastAPI:
    app = create_rest_app("Physarum Reward", "Score samples with built-in verifiers or user functions.",
                          token=auth.read_token("reward"), service="reward")

    @app.post("/v1/score", response_model=ScoreResponse)
    async def score(request: ScoreRequest) -> ScoreResponse:
        samples = [Sample(prompt=s.prompt, response=s.response, label=s.label, metadata=s.metadata, index=i)
                   for i, s in enumerate(request.samples)]
        results = await metrics.score_samples(
            samples, rm_type=request.rm_type, custom_rm_path=request.custom_rm_path, reward_key=request.reward_key,
            timeout_s=request.timeout_s or config.default_timeout_s, args=request.args, semaphore=semaphore, pool=pool)
        return ScoreResponse(scores=[ScoreOut(reward=r.reward, ok=r.ok, error=r.error, scores=r.scores)
                                     for r in results])

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
