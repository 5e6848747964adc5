"""The hostile inputs of `make fuzz`, by class: each is (class, what, send), `send()` returning a probes outcome.

Covers every gRPC method and REST endpoint without credentials, random bytes to every gRPC method, out-of-range
fields, job specs (JSON and YAML), dataset rows, reward functions and engine bodies, including each attack the
security issue lists. Where the stack runs and its credentials come from is left to `fuzz`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import yaml

from services.common import auth
from services.common.gen.physarum.v1 import buffer_pb2, jobs_pb2, reward_pb2, rollout_pb2, sample_pb2
from services.rollout.pool.router import RouterClient
from tests.fuzz import probes

Send = Callable[[], str]
INT64_MAX = 2**63 - 1
SERVICES = {"buffer": buffer_pb2, "reward": reward_pb2, "rollout": rollout_pb2, "trainer": jobs_pb2}
# Authenticated random bytes may decode into a valid call: these would really scale the pool or swap its weights.
NOT_RANDOMISED = {"Scale", "BeginWeightSync", "EndWeightSync", "StartRollout", "RunEval", "CancelJob"}
PLUGINS = "tests.plugins.reward_fns"


@dataclass
class Target:
    """The stack under test: addresses, the operator's tokens, a directory for dataset files."""

    addr: dict[str, str]        # service -> host:port (gRPC)
    urls: dict[str, str]        # reward, rollout, trainer REST base URLs
    engine_urls: list[str]
    tokens: dict[str, str]      # service -> the operator's token of it
    router_url: str
    foreign_engine_url: str     # an engine the manager never started, answering like one
    work_dir: Path
    channels: dict[str, grpc.Channel]
    http: httpx.Client


def methods(service: str) -> list[tuple[str, bool]]:
    """(full method path, server-streaming) of every RPC of `service`."""
    [svc] = SERVICES[service].DESCRIPTOR.services_by_name.values()
    return [(f"/{svc.full_name}/{m.name}", m.server_streaming) for m in svc.methods]


def _grpc(t: Target, service: str, method: str, payload: bytes, streaming: bool, metadata, authenticated: bool) -> Send:
    def send() -> str:
        if streaming:
            return _stream(t.channels[service], method, payload, metadata, authenticated)
        return probes.grpc_call(t.channels[service], method, payload, metadata=metadata, authenticated=authenticated)
    return send


def _stream(channel: grpc.Channel, method: str, payload: bytes, metadata, authenticated: bool) -> str:
    try:
        for _ in channel.unary_stream(method)(payload, timeout=5.0, metadata=metadata):
            break
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    if not authenticated:
        return probes.CLEAR if code == grpc.StatusCode.UNAUTHENTICATED else probes.UNAUTH
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return probes.CLEAR  # a stream of events of an unknown job may simply stay open until the deadline
    return probes.INTERNAL if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else probes.CLEAR


def _meta(token: str) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {token}")] if token else None


def unauthenticated_grpc(t: Target, rng: random.Random) -> Iterator[tuple[str, str, Send]]:
    """Every RPC of every service with no token, another service's token and a malformed header."""
    for service in SERVICES:
        other = next(s for s in t.tokens if s != service)
        for method, streaming in methods(service):
            for label, metadata in [("none", None), ("other", _meta(t.tokens[other])),
                                    ("basic", [("authorization", "Basic Zm9vOmJhcg==")])]:
                for payload in (b"", rng.randbytes(rng.randint(1, 64))):
                    yield ("grpc_unauthenticated", f"{method} token={label}",
                           _grpc(t, service, method, payload, streaming, metadata, authenticated=False))


def random_grpc(t: Target, rng: random.Random, per_method: int) -> Iterator[tuple[str, str, Send]]:
    """Random bytes (and truncated real messages) to every RPC, with the right token: never INTERNAL or a hang."""
    for service in SERVICES:
        for method, streaming in methods(service):
            if method.rsplit("/", 1)[1] in NOT_RANDOMISED:
                continue
            for i in range(per_method):
                payload = rng.randbytes(rng.choice([1, 3, 17, 200, 4096]))
                if i % 4 == 0:  # a field tag of a length-delimited field whose length overruns the message
                    payload = bytes([0x0A, 0xFF, 0xFF, 0x7F]) + payload[:8]
                yield ("grpc_random_bytes", f"{method} {len(payload)} bytes",
                       _grpc(t, service, method, payload, streaming, _meta(t.tokens[service]), authenticated=True))


def hostile_fields(t: Target) -> Iterator[tuple[str, str, Send]]:
    """Well-formed messages with values that stalled or killed a service before."""
    job = "fuzz-fields"
    group = sample_pb2.SampleGroup(group_id=f"{job}:0:0", job_id=job, rollout_id=INT64_MAX, prompt_index=0, epoch=0)
    buffer_calls = [
        ("PutGroups", buffer_pb2.PutGroupsRequest(groups=[group])),
        ("PutGroups", buffer_pb2.PutGroupsRequest(groups=[sample_pb2.SampleGroup(
            group_id="x", job_id=job, rollout_id=0, samples=[sample_pb2.Sample(reward=1000.0)])])),
        ("LeasePrompts", buffer_pb2.LeasePromptsRequest(job_id=job, count=1_000_000, lease_timeout_s=60)),
        ("LeasePrompts", buffer_pb2.LeasePromptsRequest(job_id=job, count=1, lease_timeout_s=math.nan)),
        ("LeasePrompts", buffer_pb2.LeasePromptsRequest(job_id=job, count=1, lease_timeout_s=math.inf)),
        ("GetBatch", buffer_pb2.GetBatchRequest(job_id=job, num_groups=1, timeout_s=math.nan)),
        ("GetBatch", buffer_pb2.GetBatchRequest(job_id=job, num_groups=2**31 - 1, timeout_s=-1)),
        ("TakeBatch", buffer_pb2.TakeBatchRequest(job_id=job, num_groups=1, timeout_s=math.inf,
                                                  min_weight_version=-INT64_MAX)),
        ("SaveState", buffer_pb2.SaveStateRequest(job_id=job, rollout_id=INT64_MAX)),
        ("ReturnPrompts", buffer_pb2.ReturnPromptsRequest(job_id=job, lease_ids=["x"] * 20000)),
        ("RestoreState", buffer_pb2.RestoreStateRequest(job_id=job, state=buffer_pb2.DataSourceState(
            num_prompts=INT64_MAX, cursor=-5, epoch=2**31 - 1, pending=["9" * 400 + ":1"]))),
        ("AppendPrompts", buffer_pb2.AppendPromptsRequest(job_id=job, position=INT64_MAX,
                                                          prompts=[sample_pb2.Prompt(prompt="x")])),
        ("AppendPrompts", buffer_pb2.AppendPromptsRequest(job_id=job, position=-1)),
        ("SaveSourcePosition", buffer_pb2.SourcePositionRequest(job_id=job, rollout_id=INT64_MAX, position=-1)),
        ("LoadDataset", buffer_pb2.LoadDatasetRequest(job_id=job, path="/etc/passwd")),
        ("LoadDataset", buffer_pb2.LoadDatasetRequest(job_id=job, path="/proc/self/environ@[0:1]")),
        ("LoadDataset", buffer_pb2.LoadDatasetRequest(job_id=job, path="x@[a:b]")),
    ]
    for job_id in ("../..", "/", "a\x00b", "x" * 100_000, "{job}", "UPPER", ""):
        buffer_calls.append(("GetStats", buffer_pb2.GetStatsRequest(job_id=job_id)))
        buffer_calls.append(("CountGroups", buffer_pb2.CountGroupsRequest(job_id=job_id, rollout_id=-INT64_MAX)))
    for name, request in buffer_calls:
        yield ("grpc_hostile_fields", f"Buffer/{name}", _grpc(t, "buffer", f"/physarum.v1.Buffer/{name}",
                                                              request.SerializeToString(), False,
                                                              _meta(t.tokens["buffer"]), authenticated=True))
    for request in [reward_pb2.ScoreRequest(rm_type="math", timeout_s=math.nan, samples=[sample_pb2.Sample()]),
                    reward_pb2.ScoreRequest(rm_type="math", timeout_s=1e300, samples=[sample_pb2.Sample()]),
                    reward_pb2.ScoreRequest(custom_rm_path="os.system", samples=[sample_pb2.Sample()]),
                    reward_pb2.ScoreRequest(custom_rm_path="subprocess.run", samples=[sample_pb2.Sample()])]:
        yield ("grpc_hostile_fields", "Reward/Score", _grpc(t, "reward", "/physarum.v1.Reward/Score",
                                                            request.SerializeToString(), False,
                                                            _meta(t.tokens["reward"]), authenticated=True))


def unauthenticated_rest(t: Target) -> Iterator[tuple[str, str, Send]]:
    """Every REST endpoint that writes, scales, loads weights or runs code, without a token or with a wrong one."""
    calls = [("POST", f"{t.urls['reward']}/v1/score", {"custom_rm_path": "os.system", "samples": [{}]}),
             ("POST", f"{t.urls['rollout']}/v1/scale", {"replicas": 1000}),
             ("GET", f"{t.urls['rollout']}/v1/engines", None),
             ("POST", f"{t.urls['trainer']}/v1/jobs", {"hf_checkpoint": "/", "prompt_data": "/etc/passwd"}),
             ("GET", f"{t.urls['trainer']}/v1/jobs", None)]
    for url in t.engine_urls:
        calls += [("POST", f"{url}/update_weights_from_disk", {"model_path": "/tmp"}),
                  ("POST", f"{url}/init_weights_update_group", {"master_address": "10.9.9.9", "master_port": 1,
                                                                 "rank_offset": 0, "world_size": 2}),
                  ("POST", f"{url}/begin_weight_update", {}), ("POST", f"{url}/update_weights_from_distributed",
                                                               {"names": [], "dtypes": [], "shapes": []}),
                  ("POST", f"{url}/pause_generation", {}), ("POST", f"{url}/abort_request", {"abort_all": True}),
                  ("POST", f"{url}/update_weight_version", {"new_version": "666"})]
    for method, url, body in calls:
        for label, headers in [("none", {}), ("wrong", auth.bearer("not-the-token-" + "x" * 30)),
                               ("other", auth.bearer(t.tokens["buffer"]))]:
            yield ("rest_unauthenticated", f"{method} {url} token={label}",
                   lambda m=method, u=url, b=body, h=headers: probes.http_call(
                       t.http, m, u, json=b, headers=h, authenticated=False))


def foreign_worker(t: Target) -> Iterator[tuple[str, str, Send]]:
    """Register a foreign engine with the router: its worker list admits only the manager's router token, so the
    call without it or with another service's must answer 401 and the foreign engine never be listed."""
    foreign = {"url": t.foreign_engine_url}
    for label, headers in [("none", {}), ("other", auth.bearer(t.tokens["buffer"]))]:
        yield ("router_foreign_worker", f"POST /workers {t.foreign_engine_url} token={label}",
               lambda h=headers: probes.http_call(t.http, "POST", f"{t.router_url}/workers", json=foreign, headers=h,
                                                  authenticated=False))

    def never_listed() -> str:
        with RouterClient(t.router_url, timeout_s=10.0) as router:  # the operator's router token: may list
            return probes.UNAUTH if router.find_worker(t.foreign_engine_url) is not None else probes.CLEAR
    yield ("router_foreign_worker", "GET /workers: the foreign engine is not listed", never_listed)


def engine_bodies(t: Target, rng: random.Random) -> Iterator[tuple[str, str, Send]]:
    """Hostile /generate bodies: huge, many samples, non-finite numbers, deep nesting, random bytes."""
    bodies = [json.dumps({"text": "1" * (30 << 20)}).encode(),
              b'{"input_ids": [5], "sampling_params": {"n": 200000}}',
              b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 1000000000}}',
              b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}',
              b'{"input_ids": [5], "sampling_params": {"top_p": Infinity}}',
              b'{"input_ids": [99999999999999999999999]}',
              b"[" * 200_000 + b"]" * 200_000, b"{}", b"null", b'"x"']
    bodies += [rng.randbytes(rng.randint(1, 512)) for _ in range(10)]
    for url in t.engine_urls[:1]:
        for body in bodies:
            yield ("engine_bodies", f"/generate {body[:40]!r} ({len(body)} bytes)",
                   lambda b=body, u=url: probes.http_call(t.http, "POST", f"{u}/generate", content=b,
                                                          headers={"content-type": "application/json"},
                                                          authenticated=True))


def job_specs(t: Target, model_dir: Path, data_path: Path) -> Iterator[tuple[str, str, Send]]:
    """Hostile job specs, as JSON bodies and as YAML files read the way `physarum submit` reads them."""
    base = {"hf_checkpoint": str(model_dir), "prompt_data": str(data_path), "num_rollout": 1, "rollout_batch_size": 2}
    raw_json = [b'{"hf_checkpoint": "/m", "prompt_data": "/d", "num_rollout": 1, "rollout_batch_size": 2, '
                b'"lr": NaN}', b'{"num_rollout": 1e999}', b'{"num_rollout": ' + b"9" * 400 + b"}",
                b"[" * 5000 + b"]" * 5000, b"{", b'{"a": 1}', b"null", b"[]", b'"spec"']
    overrides = [{"lr": float("inf")}, {"rollout_seed": 2**64}, {"global_batch_size": 0}, {"job_id": "../.."},
                 {"job_id": "/"}, {"job_id": "x" * 100_000}, {"job_id": "a\x00b"}, {"job_id": "Upper_Case"},
                 {"custom_loss_function_path": "os.system", "loss_type": "custom_loss"},
                 {"custom_generate_function_path": "subprocess.run"}, {"custom_rm_path": "os.system"},
                 {"dynamic_sampling_filter_path": "builtins.eval"}, {"n_samples_per_prompt": 10**12},
                 {"rollout_batch_size": -1}, {"num_rollout": 0}, {"rollout_temperature": -1},
                 {"unknown_key": 1}, {"rollout_stop_token_ids": [2**70]}, {"eps_clip": "nan"},
                 {"weight_sync_timeout_s": "Infinity"}]
    headers = {"content-type": "application/json", **auth.bearer(t.tokens["trainer"])}
    url = f"{t.urls['trainer']}/v1/jobs"
    for body in raw_json:
        yield ("job_specs", f"JSON {body[:40]!r}", lambda b=body: probes.http_call(
            t.http, "POST", url, content=b, headers=headers, authenticated=True))
    for override in overrides:
        text = yaml.safe_dump({**base, **override})
        yield ("job_specs", f"YAML {str(override)[:60]}", lambda s=text: _yaml_spec(t, url, headers, s))
    for text in ("a: &a [1, 2]\nb: [*a, *a, *a]\n", "!!python/object/apply:os.system ['true']\n", ":\n- : -\n"):
        yield ("job_specs", f"YAML {text[:40]!r}", lambda s=text: _yaml_spec(t, url, headers, s))


def _yaml_spec(t: Target, url: str, headers: dict, text: str) -> str:
    try:
        spec = yaml.safe_load(text)  # what physarum submit does; a tag that would run code is refused here
    except yaml.YAMLError:
        return probes.CLEAR
    body = json.dumps(spec).encode()  # as Python writes it: NaN and Infinity included
    return probes.http_call(t.http, "POST", url, content=body, headers=headers, authenticated=True)


def dataset_rows(t: Target) -> Iterator[tuple[str, str, Send]]:
    """Datasets of hostile rows, each loaded by the buffer: rows skipped or the file refused, never INTERNAL."""
    rows = ['{"input": "x", "metadata": {"s": NaN}}', '{"input": "x", "label": Infinity}',
            '{"input": "x", "metadata": ' + "[" * 5000 + "]" * 5000 + "}", '{"input": ' + '{"a": ' * 40 + "1" +
            "}" * 40 + "}", "[1, 2]", "\xff\xfe", '{"input": [{"role": 1}]}', '{"input": "' + "y" * (17 << 20) + '"}',
            '{"input": "ok", "metadata": {"n": ' + "9" * 5000 + "}}"]
    for i, row in enumerate(rows):
        path = t.work_dir / f"rows-{i}.jsonl"
        path.write_text(row + "\n", errors="surrogateescape")
        request = buffer_pb2.LoadDatasetRequest(job_id=f"fuzz-rows-{i}", path=str(path))
        yield ("dataset_rows", f"row {row[:40]!r}", _grpc(t, "buffer", "/physarum.v1.Buffer/LoadDataset",
                                                          request.SerializeToString(), False,
                                                          _meta(t.tokens["buffer"]), authenticated=True))


def reward_functions(t: Target) -> Iterator[tuple[str, str, Send]]:
    """User reward functions that exit, die, block, hog memory or raise huge errors, and code outside the allow-list:
    each fails its own sample (or the request) and the reward service keeps answering."""
    cases = [("exits", {}), ("interrupts", {}), ("dies", {}), ("blocking_sleep", {"sleep_s": 600}),
             ("hog_memory", {"num_bytes": 64 << 30}), ("huge_error", {}), ("slow", {"sleep_s": 600})]
    url, headers = f"{t.urls['reward']}/v1/score", auth.bearer(t.tokens["reward"])
    for name, args in cases:
        body = {"custom_rm_path": f"{PLUGINS}.{name}", "timeout_s": 2.0, "args": args, "samples": [{}, {}]}
        yield ("reward_functions", name, lambda b=body: _score(t, url, headers, b))
    for path in ("os.system", "builtins.eval", "tests", "tests.plugins.reward_fns", "x" * 5000):
        body = {"custom_rm_path": path, "samples": [{}]}
        yield ("reward_functions", f"path {path[:40]}", lambda b=body: _score(t, url, headers, b))
    body = {"rm_type": "math", "timeout_s": 2.0, "samples": [{"response": "1+" * (5 << 20), "label": "3"}]}
    yield ("reward_functions", "math scorer on 10 MB", lambda b=body: _score(t, url, headers, b))


def _score(t: Target, url: str, headers: dict, body: dict) -> str:
    outcome = probes.http_call(t.http, "POST", url, json=body, headers=headers, authenticated=True)
    if outcome != probes.CLEAR:
        return outcome
    health = probes.http_call(t.http, "GET", url.replace("/v1/score", "/healthz"), authenticated=True)
    return health
