"""The rollout manager's REST API (FastAPI): the engine pool by hand or by script, and its Prometheus metrics.

POST /v1/scale {"replicas": N}, GET /v1/engines, GET /metrics (the pool's and the agent gateway's), GET /healthz;
OpenAPI at /docs.
"""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from services.common import auth
from services.common.rest import create_rest_app
from services.rollout.client import PoolStatus
from services.rollout.gateway.metrics import GatewayMetrics
from services.rollout.pool.pool import EnginePool


class ScaleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(ge=0, description="desired number of engines the pool launches (external ones not counted)")


def status_json(status: PoolStatus) -> dict:
    """PoolStatus as JSON, engine states by name ("SERVING")."""
    values = dataclasses.asdict(status)
    for engine, record in zip(values["engines"], status.engines, strict=True):
        engine["state"] = record.state.name
    return values


def create_app(pool: EnginePool, gateway_metrics: GatewayMetrics | None = None) -> FastAPI:
    app = create_rest_app("Physarum rollout manager", "The engine pool: scale it, list its engines.",
                          token=auth.read_token("rollout"), service="rollout")

    @app.get("/v1/engines")
    async def engines() -> dict:
        return status_json(pool.status())

    @app.post("/v1/scale")
    async def scale(request: ScaleIn) -> dict:
        return status_json(pool.scale(request.replicas))

    @app.get("/metrics")
    async def metrics() -> Response:
        pool.update_gauges()
        gateway = gateway_metrics.exposition() if gateway_metrics is not None else b""
        return Response(pool.metrics.exposition() + gateway, media_type=CONTENT_TYPE_LATEST)

    return app
