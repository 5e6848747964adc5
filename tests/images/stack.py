"""The local stack's services, each in a container of its own image (buildah, chroot isolation), configured as the
chart configures its pods: the same `PHYSARUM_<SERVICE>_*` variables and commands, uid/gid 10001, the model and
data mounted read-only, the checkpoints volume writable, HOME on /tmp.

What differs from a cluster, and why: the containers share this machine's network, so every service binds
127.0.0.1 on a port of its own (two engines cannot both take 30000), and the rollout manager registers the engine
containers by URL (`PHYSARUM_ROLLOUT_ENGINE_URLS`) since no Kubernetes API starts them here. Redis is the machine's
redis-server (the chart runs the upstream Redis image, not one of Physarum's).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from services.common.procs import HOST, ManagedProcess, free_port, start_redis
from tests.images.buildah import Container

UID = 10001


@dataclass
class ImageStack:
    registry: str
    version: str
    work_dir: Path
    model_dir: Path
    data_dir: Path
    num_engines: int = 2
    api_token: str = "images-test-token"
    plugin_dir: Path | None = None  # a folder the plugin image's files were copied into (on PYTHONPATH)
    plugin_allowlist: str = "examples"
    processes: list[ManagedProcess] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    addr: dict[str, str] = field(default_factory=dict)

    def image(self, name: str) -> str:
        return f"{self.registry}/physarum-{name}:{self.version}"

    def _container(self, name: str, image: str, writable: list[Path] = ()) -> Container:
        mounts = [(str(self.model_dir), str(self.model_dir), True), (str(self.data_dir), str(self.data_dir), True)]
        mounts += [(str(p), str(p), False) for p in writable]
        if self.plugin_dir is not None:
            mounts.append((str(self.plugin_dir), "/opt/physarum/plugins", True))
        container = Container(image, f"physarum-images-test-{name}", mounts).create()
        self.containers.append(container)
        return container

    def _start(self, name: str, container: Container, command: list[str], env: dict[str, str]) -> ManagedProcess:
        base = {"HOME": "/tmp", "HF_HOME": "/tmp/huggingface", "PYTHONUNBUFFERED": "1",
                "PHYSARUM_PLUGIN_ALLOWLIST": self.plugin_allowlist}
        if self.plugin_dir is not None:
            base["PYTHONPATH"] = "/opt/physarum/plugins"
        proc = ManagedProcess(name, container.argv(command, {**base, **env}), self.work_dir / "logs" / f"{name}.log")
        self.processes.append(proc.start())
        return proc

    def up(self, start_timeout_s: float = 600.0) -> None:
        from physarum.stack import _grpc_ready, _http_ready

        checkpoints = self.work_dir / "checkpoints"
        checkpoints.mkdir(parents=True, exist_ok=True)
        os.chown(checkpoints, UID, UID)  # the chart's fsGroup makes the volume the pods' own
        shutil.rmtree(self.work_dir / "redis", ignore_errors=True)
        redis, redis_url = start_redis(self.work_dir / "redis")
        self.processes.append(redis)
        port = {n: free_port() for n in ("buffer", "reward", "reward_rest", "router", "router_metrics", "rollout",
                                         "rollout_rest", "trainer", "trainer_rest", "trainer_dist")}
        engine_ports = [free_port() for _ in range(self.num_engines)]
        self.addr = {n: f"{HOST}:{p}" for n, p in port.items()}
        ready = {}
        ready["buffer"] = (self._start("buffer", self._container("buffer", self.image("buffer")),
                                       ["python", "-m", "services.buffer"],
                                       {"PHYSARUM_BUFFER_HOST": HOST, "PHYSARUM_BUFFER_PORT": str(port["buffer"]),
                                        "PHYSARUM_BUFFER_REDIS_URL": redis_url}), _grpc_ready(self.addr["buffer"]))
        ready["reward"] = (self._start("reward", self._container("reward", self.image("reward")),
                                       ["python", "-m", "services.reward"],
                                       {"PHYSARUM_REWARD_HOST": HOST, "PHYSARUM_REWARD_PORT": str(port["reward"]),
                                        "PHYSARUM_REWARD_REST_PORT": str(port["reward_rest"])}),
                           _grpc_ready(self.addr["reward"]))
        ready["router"] = (self._start("router", self._container("router", self.image("router")),
                                       ["python", "-m", "sglang_router.launch_router", f"--host={HOST}",
                                        f"--port={port['router']}", f"--prometheus-host={HOST}",
                                        f"--prometheus-port={port['router_metrics']}", "--policy=round_robin"], {}),
                           _http_ready(f"http://{self.addr['router']}/liveness"))
        for i, engine_port in enumerate(engine_ports):
            name = f"engine-{i}"
            ready[name] = (self._start(name, self._container(name, self.image("engine")),
                                       ["python", "-m", "services.engine"],
                                       {"PHYSARUM_ENGINE_HOST": HOST, "PHYSARUM_ENGINE_PORT": str(engine_port),
                                        "PHYSARUM_ENGINE_MODEL_PATH": str(self.model_dir)}),
                           _http_ready(f"http://{HOST}:{engine_port}/health"))
        for proc, check in ready.values():  # the engines before the manager that registers them
            proc.wait_ready(check, timeout_s=start_timeout_s)
        rollout = self._start("rollout", self._container("rollout", self.image("rollout"), [checkpoints]),
                              ["python", "-m", "services.rollout"], {
                                  "PHYSARUM_ROLLOUT_HOST": HOST, "PHYSARUM_ROLLOUT_PORT": str(port["rollout"]),
                                  "PHYSARUM_ROLLOUT_REST_PORT": str(port["rollout_rest"]),
                                  "PHYSARUM_ROLLOUT_OWN_ROUTER": "true",
                                  "PHYSARUM_ROLLOUT_BUFFER_ADDR": self.addr["buffer"],
                                  "PHYSARUM_ROLLOUT_REWARD_ADDR": self.addr["reward"],
                                  "PHYSARUM_ROLLOUT_ROUTER_URL": f"http://{self.addr['router']}",
                                  "PHYSARUM_ROLLOUT_MODEL_PATH": str(self.model_dir),
                                  "PHYSARUM_ROLLOUT_ENGINE_URLS": ",".join(f"http://{HOST}:{p}" for p in engine_ports),
                                  "PHYSARUM_ROLLOUT_NUM_ENGINES": "0",
                                  "PHYSARUM_ROLLOUT_ENGINE_JOIN_MODE": "disk",
                                  "PHYSARUM_ROLLOUT_WEIGHT_SNAPSHOT_DIR": str(checkpoints / "weight-snapshots")})
        rollout.wait_ready(_grpc_ready(self.addr["rollout"]), timeout_s=start_timeout_s)
        trainer = self._start("trainer", self._container("trainer", self.image("trainer"), [checkpoints]),
                              ["python", "-m", "services.trainer.api.launch"], {
                                  "PHYSARUM_TRAINER_HOST": HOST, "PHYSARUM_TRAINER_PORT": str(port["trainer"]),
                                  "PHYSARUM_TRAINER_REST_PORT": str(port["trainer_rest"]),
                                  "PHYSARUM_TRAINER_BUFFER_ADDR": self.addr["buffer"],
                                  "PHYSARUM_TRAINER_ROLLOUT_ADDR": self.addr["rollout"],
                                  "PHYSARUM_TRAINER_MASTER_ADDRESS": HOST,
                                  "PHYSARUM_TRAINER_API_TOKEN": self.api_token,
                                  "PHYSARUM_TRAINER_DIST_BACKEND": "gloo",
                                  "RANK": "0", "POD_INDEX": "0", "NUM_PODS": "1", "NPROC_PER_POD": "1",
                                  "WORLD_SIZE": "1", "MASTER_ADDR": HOST, "MASTER_PORT": str(port["trainer_dist"])})
        trainer.wait_ready(_grpc_ready(self.addr["trainer"]), timeout_s=start_timeout_s)

    @property
    def trainer_url(self) -> str:
        return f"http://{self.addr['trainer_rest']}"

    def down(self) -> None:
        for proc in reversed(self.processes):
            proc.stop(grace_s=20.0)
        for container in self.containers:
            container.remove()
