"""The local stack's services, each in a container of its own image (buildah, chroot isolation), configured as the
chart configures its pods: the same commands and `PHYSARUM_<SERVICE>_*` variables, uid/gid 10001, HOME on /tmp, and
the chart's volumes at the chart's paths: the models volume (models and prompt data) read-only at /models in the
buffer, rollout manager, engines and trainer; the checkpoints volume at /checkpoints, writable in the trainer and
read-only in the buffer, the rollout manager and the engines (weight snapshots of the disk join); the plugin volume
read-only at /opt/physarum/plugins, on PYTHONPATH, in the reward, rollout manager and trainer pods.

What differs from a cluster, and why: the containers share this machine's network, so every service binds
127.0.0.1 on a port of its own (two engines cannot both take 30000), and the rollout manager registers the engine
containers by URL (`PHYSARUM_ROLLOUT_ENGINE_URLS`) since no Kubernetes API starts them here. Redis is the machine's
redis-server (the chart runs the upstream Redis image, not one of Physarum's). Service tokens are off (the chart's
auth.enabled false): they are files a Secret mounts, which the chart tests cover.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from services.common.procs import HOST, ManagedProcess, free_port, start_redis
from tests.images.buildah import Container

UID = 10001
MODELS = "/models"  # the chart's models.mountPath
CHECKPOINTS = "/checkpoints"  # the chart's checkpoints.mountPath
PLUGINS = "/opt/physarum/plugins"  # the chart's plugins.mountPath
ROUTER_POLICY = "cache_aware"  # values.yaml's router.policy
DATA_ROOTS = f"{MODELS},{CHECKPOINTS}"  # the chart's PHYSARUM_{BUFFER,TRAINER}_DATA_ROOTS
PLUGIN_PODS = ("reward", "rollout", "trainer")  # where the chart mounts the plugin volume


@dataclass
class ImageStack:
    """models_dir (here) is the models volume: a job names its files under MODELS; checkpoints go under work_dir."""

    registry: str
    version: str
    work_dir: Path
    models_dir: Path
    num_engines: int = 2
    api_token: str = "images-test-token"
    plugin_dir: Path | None = None  # a folder the plugin image's files were copied into (on PYTHONPATH)
    plugin_allowlist: str = "examples"
    processes: list[ManagedProcess] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    addr: dict[str, str] = field(default_factory=dict)

    def image(self, name: str) -> str:
        return f"{self.registry}/physarum-{name}:{self.version}"

    @property
    def checkpoints_dir(self) -> Path:
        return self.work_dir / "checkpoints"

    def _container(self, name: str, models: bool = True, checkpoints: str = "", image: str = "") -> Container:
        """A container of physarum-<name> (or `image`) with the pod's volumes; checkpoints: "rw", "ro" or ""."""
        mounts = [(str(self.models_dir), MODELS, True)] if models else []
        if checkpoints:
            mounts.append((str(self.checkpoints_dir), CHECKPOINTS, checkpoints == "ro"))
        if self.plugin_dir is not None and name in PLUGIN_PODS:
            mounts.append((str(self.plugin_dir), PLUGINS, True))
        container = Container(image or self.image(name), f"physarum-images-test-{name}", mounts).create()
        self.containers.append(container)
        return container

    def _start(self, name: str, container: Container, command: list[str], env: dict[str, str]) -> ManagedProcess:
        base = {"HOME": "/tmp", "HF_HOME": "/tmp/huggingface", "PYTHONUNBUFFERED": "1"}
        if name != "router":  # sglang-router's own image takes flags only
            base["PHYSARUM_PLUGIN_ALLOWLIST"] = self.plugin_allowlist
        if self.plugin_dir is not None and name in PLUGIN_PODS:
            base["PYTHONPATH"] = PLUGINS
        proc = ManagedProcess(name, container.argv(command, {**base, **env}), self.work_dir / "logs" / f"{name}.log")
        self.processes.append(proc.start())
        return proc

    def up(self, start_timeout_s: float = 600.0) -> None:
        from physarum.stack import _grpc_ready, _http_ready

        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.checkpoints_dir, UID, UID)  # the chart's fsGroup makes the volume the pods' own
        shutil.rmtree(self.work_dir / "redis", ignore_errors=True)
        redis, redis_url = start_redis(self.work_dir / "redis")
        self.processes.append(redis)
        port = {n: free_port() for n in ("buffer", "buffer_metrics", "reward", "reward_rest", "router",
                                         "router_metrics", "rollout", "rollout_rest", "trainer", "trainer_rest",
                                         "trainer_dist")}
        engine_ports = [free_port() for _ in range(self.num_engines)]
        self.addr = {n: f"{HOST}:{p}" for n, p in port.items()}
        ready = {}
        ready["buffer"] = (self._start("buffer", self._container("buffer", checkpoints="ro"),
                                       ["python", "-m", "services.buffer"], {
                                           "PHYSARUM_BUFFER_HOST": HOST, "PHYSARUM_BUFFER_PORT": str(port["buffer"]),
                                           "PHYSARUM_BUFFER_METRICS_PORT": str(port["buffer_metrics"]),
                                           "PHYSARUM_BUFFER_DATA_ROOTS": DATA_ROOTS,
                                           "PHYSARUM_BUFFER_REDIS_URL": redis_url}),
                           _grpc_ready(self.addr["buffer"]))
        ready["reward"] = (self._start("reward", self._container("reward", models=False),
                                       ["python", "-m", "services.reward"], {
                                           "PHYSARUM_REWARD_HOST": HOST, "PHYSARUM_REWARD_PORT": str(port["reward"]),
                                           "PHYSARUM_REWARD_REST_PORT": str(port["reward_rest"])}),
                           _grpc_ready(self.addr["reward"]))
        ready["router"] = (self._start("router", self._container("router", models=False),
                                       ["python", "-m", "sglang_router.launch_router", f"--host={HOST}",
                                        f"--port={port['router']}", f"--prometheus-host={HOST}",
                                        f"--prometheus-port={port['router_metrics']}", f"--policy={ROUTER_POLICY}"],
                                       {}),
                           _http_ready(f"http://{self.addr['router']}/liveness"))
        for i, engine_port in enumerate(engine_ports):
            name = f"engine-{i}"
            ready[name] = (self._start(name, self._container(name, checkpoints="ro", image=self.image("engine")),
                                       ["python", "-m", "services.engine"], {
                                           "PHYSARUM_ENGINE_HOST": HOST, "PHYSARUM_ENGINE_PORT": str(engine_port),
                                           "PHYSARUM_ENGINE_MODEL_PATH": f"{MODELS}/model"}),
                           _http_ready(f"http://{HOST}:{engine_port}/health"))
        for proc, check in ready.values():  # the engines before the manager that registers them
            proc.wait_ready(check, timeout_s=start_timeout_s)
        rollout = self._start("rollout", self._container("rollout", checkpoints="ro"),
                              ["python", "-m", "services.rollout"], {
                                  "PHYSARUM_ROLLOUT_HOST": HOST, "PHYSARUM_ROLLOUT_PORT": str(port["rollout"]),
                                  "PHYSARUM_ROLLOUT_REST_PORT": str(port["rollout_rest"]),
                                  "PHYSARUM_ROLLOUT_OWN_ROUTER": "true",
                                  "PHYSARUM_ROLLOUT_BUFFER_ADDR": self.addr["buffer"],
                                  "PHYSARUM_ROLLOUT_REWARD_ADDR": self.addr["reward"],
                                  "PHYSARUM_ROLLOUT_ROUTER_URL": f"http://{self.addr['router']}",
                                  "PHYSARUM_ROLLOUT_ROUTER_POLICY": ROUTER_POLICY,
                                  "PHYSARUM_ROLLOUT_MODEL_PATH": f"{MODELS}/model",
                                  "PHYSARUM_ROLLOUT_ENGINE_URLS": ",".join(f"http://{HOST}:{p}" for p in engine_ports),
                                  "PHYSARUM_ROLLOUT_NUM_ENGINES": "0",
                                  "PHYSARUM_ROLLOUT_ENGINE_JOIN_MODE": "disk",
                                  "PHYSARUM_ROLLOUT_WEIGHT_SNAPSHOT_DIR": f"{CHECKPOINTS}/weight-snapshots"})
        rollout.wait_ready(_grpc_ready(self.addr["rollout"]), timeout_s=start_timeout_s)
        trainer = self._start("trainer", self._container("trainer", checkpoints="rw"),
                              ["python", "-m", "services.trainer.ranks.launch"], {
                                  "PHYSARUM_TRAINER_HOST": HOST, "PHYSARUM_TRAINER_PORT": str(port["trainer"]),
                                  "PHYSARUM_TRAINER_REST_PORT": str(port["trainer_rest"]),
                                  "PHYSARUM_TRAINER_BUFFER_ADDR": self.addr["buffer"],
                                  "PHYSARUM_TRAINER_ROLLOUT_ADDR": self.addr["rollout"],
                                  "PHYSARUM_TRAINER_MASTER_ADDRESS": HOST,
                                  "PHYSARUM_TRAINER_DATA_ROOTS": DATA_ROOTS,
                                  "PHYSARUM_TRAINER_CHECKPOINT_ROOTS": CHECKPOINTS,
                                  "PHYSARUM_TRAINER_EXPORT_ROOTS": CHECKPOINTS,
                                  "PHYSARUM_TRAINER_JOBS_REDIS_URL": redis_url,
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
            proc.stop_group(grace_s=20.0)  # buildah run's children (the trainer's ranks...) with it
        for container in self.containers:
            container.remove()
