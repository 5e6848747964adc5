"""What an operator's first hour leans on: escape hatches on every component, unknown config refused by name, names
validated, the model/data fetch (its script run here against a local directory), Redis's password (a real
redis-server with the rendered arguments) and the trainer's drain policy."""

from __future__ import annotations

import base64
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import helm_python as helm
import pytest
import redis

from tests.chart.chart import (
    CHART,
    VALUE_SETS,
    component,
    containers,
    env_of,
    find,
    one,
    pod_spec,
    render,
    render_raw,
    values_of,
    workloads,
)

COMPONENTS = {"trainer": "trainer", "engines": "engine", "rollout": "rollout", "router": "router", "buffer": "buffer",
              "reward": "reward", "redis": "redis"}
PROVISION = CHART / "files" / "provision.sh"


def hatches(name: str) -> dict:
    return {
        "extraEnv": [{"name": "NCCL_IB_HCA", "value": f"mlx5-{name}"}],
        "envFrom": [{"secretRef": {"name": f"{name}-env"}}],
        "extraVolumes": [{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}],
        "extraVolumeMounts": [{"name": "ib", "mountPath": "/dev/infiniband"}],
        "initContainers": [{"name": "warm-up", "image": "busybox:1.36.1", "command": ["true"]}],
        "podLabels": {"kueue.x-k8s.io/queue-name": f"q-{name}"},
        "podAnnotations": {"example.com/owner": name},
        "schedulerName": "kueue-scheduler",
        "priorityClassName": f"{name}-priority",
    }


def test_every_component_takes_every_escape_hatch():
    values = {key: hatches(key) for key in COMPONENTS} | {"serviceAccount": {"annotations": {"iam.gke.io/gsa": "x"}}}
    objects = render(values)
    by_component = {component(w): w for w in workloads(objects)}
    for key, comp in COMPONENTS.items():
        w = by_component[comp]
        spec, meta, main = pod_spec(w), w["spec"]["template"]["metadata"], containers(w)[0]
        assert env_of(main)["NCCL_IB_HCA"]["value"] == f"mlx5-{key}", comp
        assert {"secretRef": {"name": f"{key}-env"}} in main["envFrom"], comp
        assert {"name": "ib", "hostPath": {"path": "/dev/infiniband"}} in spec["volumes"], comp
        assert {"name": "ib", "mountPath": "/dev/infiniband"} in main["volumeMounts"], comp
        assert [c["name"] for c in spec["initContainers"]] == ["warm-up"], comp
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == f"q-{key}", comp
        assert meta["annotations"]["example.com/owner"] == key, comp
        assert spec["schedulerName"] == "kueue-scheduler" and spec["priorityClassName"] == f"{key}-priority", comp
    for account in find(objects, "ServiceAccount"):
        assert account["metadata"]["annotations"] == {"iam.gke.io/gsa": "x"}


@pytest.mark.parametrize(("values", "message"), [
    ({"trainer": {"config": {"nmu_threads": 4}}}, r"at '/trainer/config': additional properties 'nmu_threads'"),
    ({"engines": {"cpu": {"config": {"max_batch": 4}}}}, r"'/engines/cpu/config': additional properties 'max_batch'"),
    ({"buffer": {"extraEnv": [{"value": "x"}]}}, r"at '/buffer/extraEnv/0': missing property 'name'"),
    ({"fullnameOverride": "Bad_Name"}, r"at '/fullnameOverride': .*does not match pattern"),
    ({"model": {"source": "ftp"}}, r"at '/model/source': value must be one of 'pvc', 'hf', 's3'"),
    ({"redis": {"image": {"digest": ""}}}, r"at '/redis/image"),
])
def test_render_refuses_by_name(values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"model": {"source": "hf"}}, r"model.source hf needs model.hf.repo"),
    ({"datasets": {"source": "s3", "path": "/data"}}, r"datasets.path /data must be a directory under"),
    ({"model": {"source": "hf", "hf": {"repo": "a/b"}}, "models": {"persistence": {"enabled": False}}},
     r"model.source hf downloads into the models volume"),
    ({"trainer": {"network": {"hostNetwork": True}}}, r"list the GPU nodes' CIDRs in networkPolicy.nodeCIDRs"),
])
def test_guards_refuse_contradictions(values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


def test_fetched_model_and_data_are_waited_for_by_the_pods_that_read_them():
    objects = render({"model": {"source": "hf", "hf": {"repo": "Qwen/Qwen3-8B", "revision": "v1"}},
                      "datasets": {"source": "s3", "s3": {"uri": "s3://bucket/math"}},
                      "provisioning": {"objectStore": {"endpoint": "https://s3.example.com", "secretName": "keys"}}})
    jobs = {j["metadata"]["name"].split("-")[-2]: j for j in find(objects, "Job")}
    assert set(jobs) == {"model", "data"}
    model, data = (pod_spec(jobs[k])["containers"][0] for k in ("model", "data"))
    assert model["args"] == ["hf", "Qwen/Qwen3-8B", "/models/model", "v1"]
    assert model["image"].endswith("/physarum-rollout:0.1.0")  # a CPU image with huggingface_hub's hf CLI
    assert data["args"] == ["s3", "s3://bucket/math", "/models/datasets", ""]
    assert "aws-cli" in data["image"] and {"secretRef": {"name": "keys"}} in data["envFrom"]
    assert env_of(data)["AWS_ENDPOINT_URL"]["value"] == "https://s3.example.com"
    script = one(objects, "ConfigMap", "fetch")["data"]["provision.sh"]
    assert script.strip() == PROVISION.read_text().strip()
    for w in workloads(objects):
        waits = [c for c in pod_spec(w).get("initContainers", []) if c["name"] == "wait-for-data"]
        assert bool(waits) == (component(w) in ("trainer", "engine", "rollout", "buffer")), component(w)
        for wait in waits:
            assert "/models/datasets /models/model" in wait["args"][0]
            assert wait["image"] == containers(w)[0]["image"]  # no extra image to pull
    assert not find(render({}), "Job")  # model.source pvc: the operator filled the volume


def provision(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", str(PROVISION), *args], capture_output=True, text=True, timeout=60)


def test_provision_script_fills_a_directory_once_and_writes_its_marker(tmp_path):
    source = tmp_path / "hub" / "tiny-model"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "weights.bin").write_bytes(b"\x00" * 1024)
    dest = tmp_path / "models" / "model"
    first = provision("dir", str(source), str(dest))
    assert first.returncode == 0, first.stderr
    assert (dest / "config.json").read_text() == "{}" and (dest / "sub" / "weights.bin").stat().st_size == 1024
    assert (dest / ".physarum-ready").read_text() == f"dir {source} \n"
    assert not (tmp_path / "models" / "model.partial").exists()
    (source / "config.json").write_text('{"changed": true}')  # done once: a second run does nothing
    second = provision("dir", str(source), str(dest))
    assert second.returncode == 0 and "already holds" in second.stdout
    assert (dest / "config.json").read_text() == "{}"


def test_provision_script_fails_clearly_and_leaves_no_marker(tmp_path):
    dest = tmp_path / "model"
    missing = provision("dir", str(tmp_path / "nowhere"), str(dest))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    unknown = provision("ftp", "x", str(dest))
    assert unknown.returncode == 2 and "unknown kind 'ftp'" in unknown.stderr
    assert not (dest / ".physarum-ready").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_runs_as_rendered_and_refuses_a_client_without_the_password(tmp_path):
    objects = render({})
    secret = one(objects, "Secret", "config")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    container = pod_spec(one(objects, "StatefulSet", "redis"))["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"] and "--maxmemory-policy noeviction" in container["args"][0]
    port = free_port()
    script = container["args"][0].replace("--port 6379", f"--port {port} --bind 127.0.0.1").replace(
        "--dir /data", f"--dir {tmp_path}")
    env = {**os.environ, "REDIS_PASSWORD": password}
    server = subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, server.stdout.read().decode()
                assert time.monotonic() < deadline, "redis-server did not answer in 60 s"
                time.sleep(0.2)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).set("k", "v")
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 3 * 1024**3
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        server.terminate()
        server.wait(timeout=30)


QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "kb": 2**10, "mb": 2**20, "gb": 2**30}


def to_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", text).groups()
    return int(number) * QUANTITY.get(unit, 1)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_redis_maxmemory_leaves_room_under_its_memory_limit(value_set):
    """Past maxmemory Redis refuses writes (noeviction); past the limit the kernel kills it: the first must come
    first, with room for the append-only file rewrite's fork."""
    redis_values = values_of(value_set)["redis"]
    if not redis_values["enabled"]:
        return
    assert to_bytes(redis_values["maxmemory"]) <= 0.8 * to_bytes(redis_values["resources"]["limits"]["memory"])


def test_trainer_pdb_holds_drains_by_default_and_can_let_one_through():
    pdb = one(render({}), "PodDisruptionBudget", "trainer")
    assert pdb["spec"]["maxUnavailable"] == 0
    assert one(render({"trainer": {"pdb": {"maxUnavailable": 1}}}), "PodDisruptionBudget",
               "trainer")["spec"]["maxUnavailable"] == 1
    assert not find(render({"trainer": {"pdb": {"enabled": False}}}), "PodDisruptionBudget", "trainer")


def test_docs_document_the_drain_procedure():
    doc = (Path(CHART).parents[2] / "docs" / "kubernetes.md").read_text()
    assert "## Draining a GPU node" in doc and "trainer.pdb.maxUnavailable" in doc


def test_notes_export_the_variable_the_cli_reads():
    notes = next(text for path, text in render_raw({}).items() if path.endswith("NOTES.txt"))
    cli = (Path(CHART).parents[2] / "physarum" / "cli.py").read_text()
    (variable,) = set(re.findall(r"os\.environ\.get\(\"(PHYSARUM_\w*TOKEN)\"", cli))
    assert f"export {variable}=$(kubectl" in notes
    assert not set(re.findall(r"\$(PHYSARUM_\w+)", notes)) - {variable}
