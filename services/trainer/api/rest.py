"""The job API over REST (FastAPI, OpenAPI at /docs): the same operations as the gRPC Jobs service."""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated, Unavailable
from services.common.strict_json import StrictJsonBodies
from services.trainer.api.auth import check_rest_bearer
from services.trainer.api.jobs import JobRegistry, JobState
from services.trainer.api.spec import JobSpec, parse_spec
from services.trainer.api.spec_defaults import SpecParser

_STATUS = {InvalidArgument: 400, NotFound: 404, FailedPrecondition: 409, Unavailable: 503}


def _http_error(err: Exception) -> HTTPException:
    return HTTPException(status_code=_STATUS.get(type(err), 500), detail=str(err))


def create_app(registry: JobRegistry, api_token: str = "", parse: SpecParser = parse_spec) -> FastAPI:
    """The job API; `parse` validates submitted specs (parse_spec with the trainer's spec defaults)."""
    app = FastAPI(title="Physarum job API", version="v1",
                  description="Submit, follow and cancel RL post-training jobs. Spec keys are slime's flag names.")
    app.add_middleware(StrictJsonBodies)  # NaN, 1e999999, lone surrogates: 400; the token check (added later) is first

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        """/v1/* needs the bearer token when one is configured (a job's own token opens that job's paths alone);
        /healthz, /metrics and /docs stay open."""
        if request.url.path.startswith("/v1/"):
            try:
                check_rest_bearer(request.headers.get("authorization"), api_token, request.scope["path"],
                                  registry.token_digest)
            except Unauthenticated as err:
                return JSONResponse({"detail": str(err)}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    def call(fn, *args):
        try:
            return fn(*args)
        except (InvalidArgument, NotFound, FailedPrecondition, Unavailable) as err:  # Unavailable: the job store
            raise _http_error(err) from None

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        """200 while the job queue makes progress; 503 naming why when its worker is stuck."""
        if reason := registry.health():
            return JSONResponse({"status": "stuck", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    # The body stays a mapping so that parse_spec names a bad key; its documented schema is the job spec's.
    @app.post("/v1/jobs", status_code=201, openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": JobSpec.model_json_schema()}}}})
    def submit_job(spec: dict[str, Any] = Body(..., description="job spec keyed by slime's flag names")):
        job = call(registry.submit, call(parse, spec))
        return {**JobRegistry.to_dict(job), "job_token": job.token}  # the job's own token, given this once

    @app.get("/v1/jobs")
    def list_jobs(state: str = ""):
        """Every job in submission order, or only those in `state` (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)."""
        if state and state not in JobState.__members__:
            raise HTTPException(400, f"state {state[:40]!r}: expected one of {', '.join(JobState.__members__)}")
        return {"jobs": [JobRegistry.to_dict(j) for j in registry.list(JobState(state) if state else None)]}

    @app.get("/v1/queue")
    def job_queue():
        """The running job, then the queued ones in the order they will run."""
        return {"jobs": [JobRegistry.to_dict(j) for j in registry.queue()]}

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str):
        return JobRegistry.to_dict(call(registry.get, job_id))

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel_job(job_id: str):
        return JobRegistry.to_dict(call(registry.cancel, job_id))

    @app.get("/v1/jobs/{job_id}/events")
    def job_events(job_id: str, after_seq: int = 0):
        events = call(registry.events_after, job_id, after_seq)
        return {"events": [{**e.__dict__, "state": e.state.value} for e in events]}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
