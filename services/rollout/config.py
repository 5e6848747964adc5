"""Settings of the rollout manager: its peers (buffer, reward, router), its engine pool (how engines are launched,
how many, how they join, how they are health-checked) and its timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import field


@dataclass(frozen=True, kw_only=True)
class RolloutManagerConfig:
    host: str = field("127.0.0.1", "address the gRPC server binds")
    port: int = field(50053, "gRPC port (0 picks a free one)")
    rest_port: int = field(0, "REST port: POST /v1/scale, GET /v1/engines, GET /metrics (0 picks a free one)")
    gateway_port: int = field(0, "agent gateway port: OpenAI and Anthropic APIs for agent_function_path jobs, one "
                              "session (and key) per sample (0 picks a free one)")
    gateway_url: str = field("", "the base URL agents reach the gateway at, ending in /v1 (default: "
                             "http://<host>:<gateway_port>/v1, 127.0.0.1 for a wildcard host)")
    gateway_workers: int = field(4, "agent gateway threads that parse, render and tokenize requests, off its event "
                                 "loop")
    buffer_addr: str = field("127.0.0.1:50051", "buffer service host:port")
    reward_addr: str = field("127.0.0.1:50052", "reward service host:port")
    router_url: str = field("http://127.0.0.1:30000", "sglang-router base URL; /generate goes through it")
    model_path: str = field("", "HF model directory of the engines (and the default tokenizer)")
    num_engines: int = field(0, "engines the pool launches at start (its desired replicas; change with Scale)")
    engine_urls: list[str] = field([], "already-running engines to register with the router (comma-separated)")
    engine_launcher: str = field("local", "how engines are launched: local (processes) or kubernetes (a Deployment)")
    engine_type: str = field("cpu", "local engines: cpu (Physarum's CPU engine) or sglang (python -m "
                             "sglang.launch_server)")
    sglang_args: list[str] = field([], "sglang_<server flag>=<value> options of SGLang engines (comma-separated)")
    engine_num_threads: int = field(1, "torch threads per local CPU engine")
    engine_per_token_delay_s: float = field(0.0, "extra seconds per decode step of local CPU engines (tests)")
    engine_device: str = field("cpu", "device of local CPU engines: cpu or cuda (the CPU engine on one GPU)")
    engine_fake_compute: bool = field(False, "local CPU engines run fake compute (no model; control-plane tests)")
    engine_weight_sync_timeout_s: float = field(60.0, "weight-sync timeout of local CPU engines")
    engine_start_timeout_s: float = field(120.0, "how long a new engine may take to answer /health")
    engine_join_mode: str = field("disk", "how a new engine gets the current weights before its first request: disk "
                                  "(the trainer's latest snapshot, at once) or sync (the trainer's next broadcast)")
    weight_snapshot_dir: str = field("", "where the trainer writes weight snapshots for the disk join, on storage "
                                     "the trainer and every engine share (default: work_dir/snapshots)")
    health_check_interval_s: float = field(10.0, "seconds between /health_generate checks of a serving engine "
                                           "(slime's rollout_health_check_interval)")
    health_check_timeout_s: float = field(30.0, "a check not answered in time fails the engine "
                                          "(slime's rollout_health_check_timeout)")
    health_check_first_wait_s: float = field(0.0, "wait before the first check of a new engine "
                                             "(slime's rollout_health_check_first_wait)")
    drain_timeout_s: float = field(30.0, "how long a leaving engine may take to finish its aborted requests")
    own_router: bool = field(False, "the manager owns the router's worker list: a worker it never registered is "
                             "removed (on in the chart and `physarum up`; off where managers share a router)")
    k8s_namespace: str = field("default", "kubernetes launcher: namespace of the engine Deployment")
    k8s_engine_deployment: str = field("", "kubernetes launcher: name of the engine Deployment")
    k8s_engine_selector: str = field("", "kubernetes launcher: label selector of the engine pods")
    k8s_engine_port: int = field(30000, "kubernetes launcher: the port engines listen on in their pods")
    request_timeout_s: float = field(120.0, "timeout of one /generate call through the router")
    router_policy: str = field("round_robin", "the router's policy; under consistent_hashing or manual each sample's "
                               "requests carry its session id as X-SMG-Routing-Key")
    work_dir: str = field("", "directory for engine logs (default: a new temporary directory)")
    grace_s: float = field(5.0, "seconds in-flight RPCs get on shutdown")

    def __post_init__(self) -> None:
        for name in ("port", "rest_port", "gateway_port", "k8s_engine_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"router_url must start with http:// or https://, got {self.router_url!r}")
        if self.gateway_workers < 1:
            raise ValueError(f"gateway_workers must be >= 1, got {self.gateway_workers}")
        if self.num_engines < 0:
            raise ValueError(f"num_engines must be >= 0, got {self.num_engines}")
        if self.engine_launcher not in ("local", "kubernetes"):
            raise ValueError(f"engine_launcher must be local or kubernetes, got {self.engine_launcher!r}")
        if self.engine_type not in ("cpu", "sglang"):
            raise ValueError(f"engine_type must be cpu or sglang, got {self.engine_type!r}")
        if self.engine_join_mode not in ("disk", "sync"):
            raise ValueError(f"engine_join_mode must be disk or sync, got {self.engine_join_mode!r}")
        if self.engine_launcher == "local" and self.num_engines > 0 and not self.model_path:
            raise ValueError(f"model_path is required to start {self.num_engines} local engines")
        if self.engine_launcher == "kubernetes" and not (self.k8s_engine_deployment and self.k8s_engine_selector):
            raise ValueError("engine_launcher kubernetes needs k8s_engine_deployment and k8s_engine_selector")
        if self.engine_per_token_delay_s < 0 or self.health_check_first_wait_s < 0:
            raise ValueError("engine_per_token_delay_s and health_check_first_wait_s must be >= 0")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_urls: {url!r} must start with http:// or https://")
        if self.engine_num_threads < 1:
            raise ValueError(f"engine_num_threads must be >= 1, got {self.engine_num_threads}")
        for name in ("engine_start_timeout_s", "request_timeout_s", "grace_s", "engine_weight_sync_timeout_s",
                     "health_check_interval_s", "health_check_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
