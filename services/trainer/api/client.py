"""Clients of the job API: gRPC (`JobsClient`) and REST (`JobsRestClient`, what the CLI uses), and what a client may
ask before it submits a job or starts a stack (torch-free): what each backend can do and builds, the default one."""

from __future__ import annotations

from typing import Any

import httpx

from services.common import auth
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated, Unavailable
from services.common.gen.physarum.v1 import jobs_pb2, jobs_pb2_grpc
from services.common.grpc_client import GrpcClient
from services.common.http_client import HttpClient
from services.common.samples import dict_to_struct, struct_to_dict
from services.trainer.backends import capabilities as backends
from services.trainer.backends.layout import LayoutConfig

TERMINAL_STATES = {"SUCCEEDED", "FAILED", "CANCELLED"}
DEFAULT_TRAIN_BACKEND: str = LayoutConfig.train_backend  # what a spec that names no train_backend gets


def backend_capabilities(train_backend: str) -> backends.Capabilities:
    """What `train_backend` can do (e.g. `tensor_parallel`: it splits a model over ranks)."""
    return backends.capabilities(train_backend)


def model_problem(train_backend: str, hf_config: dict[str, Any]) -> str:
    """Why `train_backend` cannot build the model of `hf_config` (its config.json), "" when it can: the job API's own
    check at submit."""
    return backends.model_problem(train_backend, hf_config)


def job_from_proto(job: jobs_pb2.Job) -> dict[str, Any]:
    return {"job_id": job.job_id, "state": jobs_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_"),
            "spec": struct_to_dict(job.spec), "rollout_id": job.rollout_id, "num_rollout": job.num_rollout,
            "metrics": dict(job.metrics), "error": job.error, "created_at": job.created_at,
            "finished_at": job.finished_at, "attempts": job.attempts, "checkpoints": list(job.checkpoints)}


class JobsClient(GrpcClient):
    service = "trainer"

    def __init__(self, addr: str, timeout_s: float = 10.0, token: str = "") -> None:
        super().__init__(addr, timeout_s)
        self.stub = jobs_pb2_grpc.JobsStub(self.channel)
        if token:
            self.metadata = (("authorization", f"Bearer {token}"),)

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The job as submitted, with its own token (`job_token`) for its REST paths."""
        reply = self.call(self.stub.SubmitJob, jobs_pb2.SubmitJobRequest(spec=dict_to_struct(spec)))
        return {**job_from_proto(reply), "job_token": reply.job_token}

    def get(self, job_id: str) -> dict[str, Any]:
        return job_from_proto(self.call(self.stub.GetJob, jobs_pb2.GetJobRequest(job_id=job_id), idempotent=True))

    def list(self, state: str = "") -> list[dict[str, Any]]:
        """Every job in submission order, or only those in `state` ("QUEUED", ...)."""
        request = jobs_pb2.ListJobsRequest(state=jobs_pb2.JobState.Value(f"JOB_STATE_{state}") if state else 0)
        reply = self.call(self.stub.ListJobs, request, idempotent=True)
        return [job_from_proto(j) for j in reply.jobs]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return job_from_proto(self.call(self.stub.CancelJob, jobs_pb2.CancelJobRequest(job_id=job_id),
                                        idempotent=True))

    def stream_events(self, job_id: str, after_seq: int = 0, timeout_s: float = 3600.0):
        """Yield events as dicts until the job ends or timeout_s passes."""
        request = jobs_pb2.StreamEventsRequest(job_id=job_id, after_seq=after_seq)
        for event in self.stub.StreamEvents(request, timeout=timeout_s, metadata=self.metadata):
            yield {"seq": event.seq, "state": jobs_pb2.JobState.Name(event.state).removeprefix("JOB_STATE_"),
                   "rollout_id": event.rollout_id, "metrics": dict(event.metrics), "message": event.message,
                   "time": event.time}


class JobsRestClient(HttpClient):
    """The REST job API at `url` ("http://127.0.0.1:8080")."""

    def __init__(self, url: str, timeout_s: float = 10.0, token: str = "") -> None:
        token = token or auth.read_token("trainer")  # default: this process's token file (services.common.auth)
        super().__init__(url, timeout_s, headers={"Authorization": f"Bearer {token}"} if token else None)

    def _call(self, method: str, path: str, **kwargs) -> Any:
        try:
            try:
                reply = self.http.request(method, path, **kwargs)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                if method != "GET":
                    raise
                # a kept-alive connection the server closed as the request went out: a read, once more on a new one
                reply = self.http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise Unavailable(f"job API {self.url}: {type(err).__name__}: {err}") from err
        if reply.status_code >= 400:
            detail = reply.json().get("detail", reply.text) if reply.content else reply.reason_phrase
            cls = {400: InvalidArgument, 401: Unauthenticated, 404: NotFound, 409: FailedPrecondition,
                   503: Unavailable}.get(reply.status_code, FailedPrecondition)
            raise cls(f"job API {method} {path}: {detail}")
        return reply.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def list(self, state: str = "") -> list[dict[str, Any]]:
        """Every job in submission order, or only those in `state` ("QUEUED", ...)."""
        return self._call("GET", "/v1/jobs", params={"state": state} if state else None)["jobs"]

    def queue(self) -> list[dict[str, Any]]:
        """The running job, then the queued ones in the order they will run."""
        return self._call("GET", "/v1/queue")["jobs"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def events(self, job_id: str, after_seq: int = 0) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/jobs/{job_id}/events", params={"after_seq": after_seq})["events"]
