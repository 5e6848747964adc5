"""The trainer pod's entry point and probe scripts, run for real: the pod starts the launcher (one rank per GPU, rank 0
the service), and the exec probes check rank 0's gRPC health (a pod of workers, which serve nothing, passes)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.trainer.api.job_store import LOAD_TIMEOUT_S
from services.trainer.api.server import QUEUE_HEALTH, RECORDS_TIMEOUT_S
from tests.chart.chart import one, pod_spec, render


def trainer_container(values: dict) -> dict:
    return pod_spec(one(render(values), "StatefulSet", "trainer"))["containers"][0]


@pytest.mark.parametrize("pod, local, module", [("0", 0, "services.trainer"), ("0", 1, "services.trainer.ranks.worker"),
                                                ("3", 0, "services.trainer.ranks.worker")])
def test_the_pod_launches_one_rank_per_gpu(pod, local, module):
    from services.trainer.ranks.launch import rank_command, rank_envs

    container = trainer_container({"trainer": {"replicas": 4, "gpus": 2}})
    assert container["command"] == ["python", "-m", "services.trainer.ranks.launch"] and "args" not in container
    env = {e["name"]: e.get("value") for e in container["env"]}
    envs = rank_envs(pod_index=int(pod), num_pods=int(env["NUM_PODS"]), nproc_per_pod=int(env["NPROC_PER_POD"]))
    assert envs[local]["WORLD_SIZE"] == env["WORLD_SIZE"] == "8"
    assert rank_command(int(envs[local]["RANK"]))[1:] == ["-m", module]


def run_probe(container: dict, kind: str, rank: str) -> int:
    command = container[kind]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    env = {**os.environ, "RANK": rank}
    return subprocess.run([sys.executable, "-c", command[2]], env=env, capture_output=True, timeout=15).returncode


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield server, servicer, port
    server.stop(grace=None)


def test_probes_check_rank_zeros_grpc_health(health_server):
    server, servicer, port = health_server
    container = trainer_container({"trainer": {"port": port}})
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(QUEUE_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    assert [run_probe(container, k, "0") for k in ("startupProbe", "readinessProbe", "livenessProbe")] == [0, 0, 0]

    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # e.g. draining: unready, but alive
    assert run_probe(container, "readinessProbe", "0") == 1
    assert run_probe(container, "livenessProbe", "0") == 0

    servicer.set(QUEUE_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)  # a stuck job queue: restart the pod
    assert run_probe(container, "livenessProbe", "0") == 1

    server.stop(grace=None).wait()  # nothing listens: rank 0 is neither ready nor alive
    assert run_probe(container, "readinessProbe", "0") != 0
    assert run_probe(container, "livenessProbe", "0") != 0
    assert run_probe(container, "readinessProbe", "3") == 0  # a worker serves nothing; its process is the container


@pytest.mark.parametrize("values, backend", [({}, "megatron"), ({"trainer": {"defaultTrainBackend": "fsdp"}}, "fsdp")])
def test_jobs_default_to_the_megatron_backend_on_the_cluster(values, backend, monkeypatch):
    from services.common.config import load_config
    from services.trainer.api.config import TrainerConfig
    from services.trainer.api.spec_defaults import spec_defaults, spec_parser

    env = {e["name"]: e.get("value") for e in trainer_container(values)["env"]}
    assert env["PHYSARUM_TRAINER_DEFAULT_TRAIN_BACKEND"] == backend
    monkeypatch.setenv("PHYSARUM_TRAINER_DEFAULT_TRAIN_BACKEND", backend)
    parse = spec_parser(spec_defaults(load_config(TrainerConfig, "trainer", argv=[])))
    spec = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 1, "rollout_batch_size": 2}
    assert parse(spec).train_backend == backend


def test_the_charts_trainer_confines_job_paths_to_its_volumes(monkeypatch):
    """The trainer's roots, from the rendered pod's environment as the trainer reads it: data and models from the
    models and checkpoints volumes, checkpoints and exports onto the checkpoints volume, nothing else."""
    from services.common.config import load_config
    from services.common.errors import InvalidArgument
    from services.trainer.api.config import TrainerConfig
    from services.trainer.api.spec_defaults import path_roots, spec_parser

    env = {e["name"]: e["value"] for e in trainer_container({})["env"]
           if e["name"].endswith("_ROOTS") and "value" in e}
    assert set(env) == {"PHYSARUM_TRAINER_DATA_ROOTS", "PHYSARUM_TRAINER_CHECKPOINT_ROOTS",
                        "PHYSARUM_TRAINER_EXPORT_ROOTS"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parse = spec_parser({}, path_roots(load_config(TrainerConfig, "trainer", [])))
    base = {"hf_checkpoint": "/models/qwen", "prompt_data": "/checkpoints/data/train.jsonl", "num_rollout": 2,
            "rollout_batch_size": 2}
    job = parse({**base, "save": "/checkpoints/run", "load": "/checkpoints/run", "save_hf": "/checkpoints/hf",
                 "ref_load": "/models/qwen", "use_kl_loss": True})
    assert job.save == "/checkpoints/run"
    for key, path in [("prompt_data", "/etc/passwd"), ("save", "/checkpoints/../elsewhere"), ("save", "/models/x"),
                      ("save_hf", "../x"), ("save_debug_rollout_data", "/checkpoints/../tmp/{rollout_id}.pt"),
                      ("hf_checkpoint", "/root/model")]:
        with pytest.raises(InvalidArgument, match=f"job spec: {key}\\S* .* lies outside the allowed directories"):
            parse({**base, key: path})


@pytest.mark.parametrize("grace", [120, 600])
def test_the_grace_period_covers_the_jobs_preemption_and_pods_always_restart(grace, monkeypatch):
    """What SIGTERM needs (the trainer's __main__): the job gets preempt_timeout_s to checkpoint and stop, which the
    chart keeps 15 s inside terminationGracePeriodSeconds; a pod that exits (0 after SIGTERM, or killed) is started
    again by the StatefulSet (restartPolicy Always, the only one it allows), and its jobs resume."""
    from services.common.config import load_config
    from services.trainer.api.config import TrainerConfig

    sts = one(render({"trainer": {"terminationGracePeriodSeconds": grace}}), "StatefulSet", "trainer")
    pod = pod_spec(sts)
    assert pod["terminationGracePeriodSeconds"] == grace
    assert pod.get("restartPolicy", "Always") == "Always"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    monkeypatch.setenv("PHYSARUM_TRAINER_PREEMPT_TIMEOUT_S", env["PHYSARUM_TRAINER_PREEMPT_TIMEOUT_S"])
    config = load_config(TrainerConfig, "trainer", [])
    assert config.preempt_timeout_s == grace - 15
    # after the job stopped, the stop writes the records and lets in-flight calls end, each bounded, inside the 15 s
    assert RECORDS_TIMEOUT_S + config.grace_s <= grace - config.preempt_timeout_s - 5  # 5 s: the process's exit
    # liveness gives a stuck queue a few checks before the restart, and never fires on a draining (unready) pod
    liveness = pod["containers"][0]["livenessProbe"]
    assert "physarum.v1.Jobs.queue" in liveness["exec"]["command"][2]
    # a starting trainer waits for Redis to load its job records (then exits): the startup probe waits longer
    startup = pod["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > LOAD_TIMEOUT_S
