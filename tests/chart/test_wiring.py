"""How the chart wires the services: entry points and images, the PHYSARUM_<SERVICE>_<FIELD> env the services read,
peer addresses, scaling ownership (HPA or rollout manager), minimal RBAC, NetworkPolicies, Redis, the Secret and
ServiceMonitors."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import json
import re
import subprocess

import pytest
import yaml

from services.buffer.config import BufferConfig
from services.common.config import load_config
from services.engine.config import EngineConfig
from services.reward.config import RewardConfig
from services.rollout.config import RolloutManagerConfig
from services.trainer.api.config import TrainerConfig
from tests.chart.chart import (
    CHART,
    ROOT,
    component,
    container_ports,
    containers,
    env_of,
    find,
    one,
    pod_labels,
    pod_spec,
    render,
    values_of,
    workloads,
)

# service name in PHYSARUM_<SERVICE>_<FIELD> -> (entry module, config class)
SERVICES = {
    "buffer": ("services.buffer", BufferConfig),
    "reward": ("services.reward", RewardConfig),
    "rollout": ("services.rollout", RolloutManagerConfig),
    "engine": ("services.engine", EngineConfig),
    "trainer": ("services.trainer", TrainerConfig),
}
CHART_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
# Settings the chart passes that the services do not read yet (load_config refuses unknown variables: keep it empty).
PENDING_FIELDS: dict[str, set[str]] = {}
RELEASE_PEER = {"app.kubernetes.io/instance": "demo", "app.kubernetes.io/part-of": "physarum"}


TRAINER_LAUNCH = ["python", "-m", "services.trainer.ranks.launch"]  # one rank per GPU: services.trainer and its workers


def physarum_containers(objects):
    """(workload, container, service) for each container that runs a Physarum entry point."""
    for w in workloads(objects):
        for c in containers(w):
            if c.get("command") == TRAINER_LAUNCH:
                yield w, c, "trainer"
                continue
            for service, (module, _) in SERVICES.items():
                if c.get("command") == ["python", "-m", module]:
                    yield w, c, service


def test_containers_run_the_local_entry_points(objects, value_set):
    found = {service for _, _, service in physarum_containers(objects)}
    backend = values_of(value_set)["engines"]["backend"]
    assert found == {"buffer", "reward", "rollout", "trainer"} | ({"engine"} if backend == "cpu" else set())
    ranks = ["services.trainer.ranks.worker", "services.trainer.ranks.launch"]
    for module in [m for m, _ in SERVICES.values()] + ranks:
        assert importlib.util.find_spec(module) is not None, module
    router = one(objects, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    # with auth on, a shell adds the token file's key to the same module's command line (test_auth.py)
    assert "python -m sglang_router.launch_router" in " ".join(router["command"])
    assert importlib.util.find_spec("sglang_router.launch_router") is not None


def make_image_names(values: dict, variant: str) -> dict[str, str]:
    """service -> the name `make images REGISTRY=<image.registry> VERSION=<tag> VARIANT=<variant>` tags."""
    version = values["image"]["tag"] or yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    result = subprocess.run(["make", "-s", "-C", str(ROOT), "image-names", f"REGISTRY={values['image']['registry']}",
                             f"VERSION={version}", f"VARIANT={variant}"], capture_output=True, text=True, timeout=60,
                            check=True)
    return {name.rsplit("/", 1)[1].split(":")[0].removeprefix("physarum-"): name for name in result.stdout.split()}


def test_images_are_the_ones_make_images_builds(objects, value_set):
    """The chart's defaults pull what `make images` builds and `make push` pushes: REGISTRY/physarum-<service>:VERSION,
    the trainer with GPUs VERSION-gpu (VARIANT=gpu)."""
    values = values_of(value_set)
    cpu, gpu = make_image_names(values, "cpu"), make_image_names(values, "gpu")
    assert cpu["buffer"] == f"localhost:5000/physarum-buffer:{CHART_VERSION}" or value_set != "default"
    for _, c, service in physarum_containers(objects):
        expected = gpu if service == "trainer" and values["trainer"]["gpus"] > 0 else cpu
        assert c["image"] == expected[service]
        assert (ROOT / "deploy" / "docker" / f"{service}.Dockerfile").is_file()
    router = one(objects, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    assert router["image"] == cpu["router"]


def test_sglang_backend_runs_sglang_server(objects, value_set):
    values = values_of(value_set)
    if values["engines"]["backend"] != "sglang":
        return
    c = one(objects, "Deployment", "engine")["spec"]["template"]["spec"]["containers"][0]
    image = values["engines"]["sglang"]["image"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", image["digest"])  # SGLang's own image, pinned by digest
    assert c["image"] == f"{image['repository']}:{image['tag']}@{image['digest']}"
    assert "python3 -m sglang.launch_server" in " ".join(c["command"])  # with auth on, through a shell (test_auth.py)
    assert f"--model-path={values['model']['path']}" in c["args"]
    assert f"--tp-size={values['engines']['gpus']}" in c["args"]
    assert f"--port={values['engines']['port']}" in c["args"] and "--host=0.0.0.0" in c["args"]
    assert not any(name.startswith("PHYSARUM_") for name in env_of(c))


# read by every process, not by one service's config: the token directory and the plugin allow-list
PROCESS_ENV = {"PHYSARUM_TOKEN_DIR", "PHYSARUM_PLUGIN_ALLOWLIST"}


def test_env_names_are_config_fields(objects):
    for _, c, service in physarum_containers(objects):
        fields = {f.name for f in dataclasses.fields(SERVICES[service][1])} | PENDING_FIELDS.get(service, set())
        prefix = f"PHYSARUM_{service.upper()}_"
        for name in env_of(c):
            if name.startswith("PHYSARUM_") and name not in PROCESS_ENV:
                assert name.startswith(prefix), (service, name)
                assert name[len(prefix):].lower() in fields, (service, name)


def resolve_env(objects, container, tmp_path) -> dict[str, str]:
    """The container's environment as Kubernetes would set it, from the rendered Secret and placeholder fieldRefs."""
    secrets = {s["metadata"]["name"]: s.get("data", {}) for s in find(objects, "Secret")}
    env = {}
    for name, entry in env_of(container).items():
        if "value" in entry:
            env[name] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            data = secrets.get(ref["name"], {})
            env[name] = base64.b64decode(data[ref["key"]]).decode() if ref["key"] in data else "external-secret"
        else:
            env[name] = "0"
    return env


def test_services_accept_the_env_the_chart_gives_them(objects, monkeypatch, tmp_path):
    """load_config reads every container's env as the service would at start (the engine's model dir is faked)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    for _, c, service in physarum_containers(objects):
        with monkeypatch.context() as patch:
            env = resolve_env(objects, c, tmp_path)
            if service == "engine":
                env["PHYSARUM_ENGINE_MODEL_PATH"] = str(model_dir)
            for name, value in env.items():
                patch.setenv(name, value)
            config = load_config(SERVICES[service][1], service, argv=[])
        assert config.host == "0.0.0.0"  # reachable through its Service
        assert config.port == container_ports(c)["grpc" if service != "engine" else "http"]


def test_config_values_reach_the_services_typed():
    objects = render({"trainer": {"config": {"num_threads": 1000000, "client_timeout_s": 0.5}},
                      "rollout": {"config": {"engine_urls": ["http://a:30000", "http://b:30000"],
                                             "request_timeout_s": 300}},
                      "buffer": {"config": {"redis_wait_s": 2.5}}})
    env = {s: env_of(c) for _, c, s in physarum_containers(objects)}
    assert env["trainer"]["PHYSARUM_TRAINER_NUM_THREADS"]["value"] == "1000000"  # not 1e+06
    assert env["trainer"]["PHYSARUM_TRAINER_CLIENT_TIMEOUT_S"]["value"] == "0.5"
    assert env["rollout"]["PHYSARUM_ROLLOUT_ENGINE_URLS"]["value"] == "http://a:30000,http://b:30000"
    assert env["rollout"]["PHYSARUM_ROLLOUT_REQUEST_TIMEOUT_S"]["value"] == "300"
    assert env["buffer"]["PHYSARUM_BUFFER_REDIS_WAIT_S"]["value"] == "2.5"


def test_peers_are_addressed_by_service_name_and_port(objects, value_set):
    values = values_of(value_set)
    services = {s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]} for s in find(objects, "Service")}
    env = {s: env_of(c) for _, c, s in physarum_containers(objects)}
    addrs = [env["trainer"]["PHYSARUM_TRAINER_BUFFER_ADDR"]["value"], env["trainer"]["PHYSARUM_TRAINER_ROLLOUT_ADDR"]
             ["value"], env["rollout"]["PHYSARUM_ROLLOUT_BUFFER_ADDR"]["value"],
             env["rollout"]["PHYSARUM_ROLLOUT_REWARD_ADDR"]["value"],
             env["rollout"]["PHYSARUM_ROLLOUT_ROUTER_URL"]["value"].removeprefix("http://")]
    for addr in addrs:
        host, port = addr.rsplit(":", 1)
        assert int(port) in services[host], addr
    assert env["rollout"]["PHYSARUM_ROLLOUT_MODEL_PATH"]["value"] == values["model"]["path"]
    assert env["rollout"]["PHYSARUM_ROLLOUT_ROUTER_POLICY"]["value"] == values["router"]["policy"]


def test_rollout_manager_finds_engine_pods_by_their_labels(objects, value_set):
    env = env_of(one(objects, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"][0])
    engines = one(objects, "Deployment", "engine")
    assert env["PHYSARUM_ROLLOUT_ENGINE_LAUNCHER"]["value"] == "kubernetes"
    selector = dict(pair.split("=") for pair in env["PHYSARUM_ROLLOUT_K8S_ENGINE_SELECTOR"]["value"].split(","))
    assert selector == engines["spec"]["selector"]["matchLabels"]
    assert env["PHYSARUM_ROLLOUT_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["PHYSARUM_ROLLOUT_K8S_ENGINE_DEPLOYMENT"]["value"] == engines["metadata"]["name"]
    assert int(env["PHYSARUM_ROLLOUT_K8S_ENGINE_PORT"]["value"]) == container_ports(containers(engines)[0])["http"]


def test_new_engines_get_weights_from_a_volume_the_trainer_shares(objects, value_set):
    values = values_of(value_set)
    env = env_of(one(objects, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"][0])
    assert env["PHYSARUM_ROLLOUT_ENGINE_JOIN_MODE"]["value"] == values["engines"]["joinMode"]
    engine_mounts = {m["name"]: m for m in containers(one(objects, "Deployment", "engine"))[0]["volumeMounts"]}
    if values["engines"]["joinMode"] == "sync":
        assert "PHYSARUM_ROLLOUT_WEIGHT_SNAPSHOT_DIR" not in env and "checkpoints" not in engine_mounts
        return
    snapshots = env["PHYSARUM_ROLLOUT_WEIGHT_SNAPSHOT_DIR"]["value"]
    trainer = one(objects, "StatefulSet", "trainer")
    trainer_mount = next(m for m in containers(trainer)[0]["volumeMounts"] if m["name"] == "checkpoints")
    assert snapshots.startswith(trainer_mount["mountPath"] + "/") and not trainer_mount.get("readOnly")
    assert engine_mounts["checkpoints"]["mountPath"] == trainer_mount["mountPath"]  # same paths on both sides
    assert engine_mounts["checkpoints"]["readOnly"] is True
    claims = [v["persistentVolumeClaim"]["claimName"] for w in (trainer, one(objects, "Deployment", "engine"))
              for v in pod_spec(w)["volumes"] if v["name"] == "checkpoints"]
    assert len(claims) == 2 and claims[0] == claims[1]


@pytest.mark.parametrize("reader", ["buffer", "rollout"])
def test_the_pods_that_read_a_jobs_files_mount_the_trainers_data_roots(objects, value_set, reader):
    """A job's prompt_data (read by the buffer) and hf_checkpoint (the tokenizer the rollout manager loads) may be
    under any of the trainer's data roots, e.g. a model an SFT job saved on the checkpoints volume: both pods mount
    each shared volume there, read-only, from the same claim."""
    trainer = one(objects, "StatefulSet", "trainer")
    pod = one(objects, "Deployment", reader)
    roots = env_of(containers(trainer)[0])["PHYSARUM_TRAINER_DATA_ROOTS"]["value"].split(",")
    trainer_mounts = {m["mountPath"]: m["name"] for m in containers(trainer)[0]["volumeMounts"]}
    pod_mounts = {m["mountPath"]: m for m in containers(pod)[0]["volumeMounts"]}
    trainer_claims, pod_claims = ({v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod_spec(w)["volumes"]
                                   if "persistentVolumeClaim" in v} for w in (trainer, pod))
    access = values_of(value_set)["checkpoints"]["persistence"]["accessMode"]
    shared = 0
    for root in roots:
        volume = trainer_mounts.get(root)
        if volume not in trainer_claims or (volume == "checkpoints" and access == "ReadWriteOnce"):
            continue  # the trainer's own (an emptyDir, or a claim one node attaches): nothing to share
        mount = pod_mounts.get(root)
        assert mount and mount.get("readOnly") is True, f"the {reader} pod does not mount {root} read-only"
        assert pod_claims[mount["name"]] == trainer_claims[volume]
        shared += 1
    assert shared or value_set == "minimal", "a value set with shared volumes shares none"


def test_one_scaler_owns_engine_replicas(objects, value_set):
    engines = values_of(value_set)["engines"]
    deployment = one(objects, "Deployment", "engine")
    hpas = find(objects, "HorizontalPodAutoscaler", "engine")
    manager_env = env_of(one(objects, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"][0])
    rules = one(objects, "Role", "rollout")["rules"]
    can_scale = any("deployments/scale" in r["resources"] and "patch" in r["verbs"] for r in rules)
    assert not (hpas and can_scale)
    desired = int(manager_env["PHYSARUM_ROLLOUT_NUM_ENGINES"]["value"])  # 0: the manager never patches the scale
    if engines["hpa"].get("enabled"):
        assert "replicas" not in deployment["spec"]  # the HPA owns it; helm upgrade must not reset it
        assert hpas[0]["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                     "name": deployment["metadata"]["name"]}
        assert desired == 0 and not can_scale
    elif engines["managerScaling"]["enabled"]:
        assert "replicas" not in deployment["spec"] and not hpas and can_scale
        assert desired == engines["replicas"]
    else:
        assert deployment["spec"]["replicas"] == engines["replicas"] and not hpas and not can_scale
        assert desired == 0


def test_reward_hpa_scales_on_cpu_requests(objects, value_set):
    hpa_values = values_of(value_set)["reward"]["hpa"]
    deployment = one(objects, "Deployment", "reward")
    hpas = find(objects, "HorizontalPodAutoscaler", "reward")
    if not hpa_values["enabled"]:
        assert not hpas and deployment["spec"]["replicas"] == values_of(value_set)["reward"]["replicas"]
        return
    assert "replicas" not in deployment["spec"]
    metric = hpas[0]["spec"]["metrics"][0]["resource"]
    assert metric["name"] == "cpu"
    assert metric["target"]["averageUtilization"] == hpa_values["targetCPUUtilizationPercentage"]
    assert all("cpu" in c["resources"]["requests"] for c in containers(deployment))  # utilization needs a request


def test_rbac_is_the_rollout_managers_and_minimal(objects, value_set):
    assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")
    role = one(objects, "Role", "rollout")
    manager_scales = values_of(value_set)["engines"]["managerScaling"]["enabled"]
    engine = one(objects, "Deployment", "engine")["metadata"]["name"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": [engine],
         "verbs": ["get", "patch"] if manager_scales else ["get"]},
    ]
    binding = one(objects, "RoleBinding", "rollout")
    manager = one(objects, "Deployment", "rollout")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec(manager)["serviceAccountName"],
                                    "namespace": "rl"}]
    for w in workloads(objects):  # only the manager's pods get an API token
        assert pod_spec(w)["automountServiceAccountToken"] is (w is manager), w["metadata"]["name"]


# The NetworkPolicies, per component and port: test_network_policy.py.


def test_release_pods_carry_the_peer_labels(objects):
    for w in workloads(objects):
        assert RELEASE_PEER.items() <= pod_labels(w).items()


def test_redis_keeps_an_append_only_file_on_a_volume(objects, value_set):
    values = values_of(value_set)["redis"]
    if not values["enabled"]:
        assert not find(objects, "StatefulSet", "redis")
        return
    sts = one(objects, "StatefulSet", "redis")
    args = pod_spec(sts)["containers"][0]["args"][0].split("<<")[0].split()
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == values["appendfsync"]
    assert args[args.index("--dir") + 1] == "/data"
    claims = [t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])]
    assert claims == (["data"] if values["persistence"]["enabled"] else [])
    assert sts["spec"]["serviceName"] == one(objects, "Service", "redis")["metadata"]["name"]


def test_secret_holds_the_token_and_the_redis_url(objects, value_set):
    values = values_of(value_set)
    data = {k: base64.b64decode(v).decode() for k, v in one(objects, "Secret", "config")["data"].items()}
    buffer_env = env_of(pod_spec(one(objects, "Deployment", "buffer"))["containers"][0])
    if values["redis"]["enabled"]:  # the URL carries the password from the Secret, expanded by the kubelet
        assert "redis-url" not in data and len(data["redis-password"]) >= 32
        assert buffer_env["PHYSARUM_BUFFER_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@demo-physarum-redis:6379/0"
        assert buffer_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "demo-physarum",
                                                                           "key": "redis-password"}
        assert list(buffer_env).index("REDIS_PASSWORD") < list(buffer_env).index("PHYSARUM_BUFFER_REDIS_URL")
    else:
        assert data["redis-url"] == values["redis"]["externalUrl"] and "redis-password" not in data
        assert buffer_env["PHYSARUM_BUFFER_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"
    # the trainer keeps its job records in the same Redis, reached the same way
    trainer_env = env_of(pod_spec(one(objects, "StatefulSet", "trainer"))["containers"][0])
    records = trainer_env["PHYSARUM_TRAINER_JOBS_REDIS_URL"]
    assert records == {k: v for k, v in buffer_env["PHYSARUM_BUFFER_REDIS_URL"].items() if k != "name"} | \
        {"name": "PHYSARUM_TRAINER_JOBS_REDIS_URL"}
    if values["redis"]["enabled"]:
        assert trainer_env["REDIS_PASSWORD"] == buffer_env["REDIS_PASSWORD"]
        assert list(trainer_env).index("REDIS_PASSWORD") < list(trainer_env).index("PHYSARUM_TRAINER_JOBS_REDIS_URL")
    token_ref = env_of(pod_spec(one(objects, "StatefulSet", "trainer"))["containers"][0])["PHYSARUM_TRAINER_API_TOKEN"]
    if values["jobApi"]["existingSecret"]:
        assert "api-token" not in data
        secret = values["jobApi"]["existingSecret"]
        assert token_ref["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "api-token"}
    else:
        assert len(data["api-token"]) >= 16
        assert token_ref["valueFrom"]["secretKeyRef"] == {"name": "demo-physarum", "key": "api-token"}


def test_a_given_token_is_used_as_is():
    secret = one(render({"jobApi": {"token": "s3cret-token-of-mine"}}), "Secret", "config")
    assert base64.b64decode(secret["data"]["api-token"]).decode() == "s3cret-token-of-mine"


def test_shared_volumes_are_mounted_and_kept(objects, value_set):
    values = values_of(value_set)
    claims = {c["metadata"]["name"]: c for c in find(objects, "PersistentVolumeClaim")}
    for c in claims.values():
        assert c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # uninstall keeps checkpoints
    trainer = pod_spec(one(objects, "StatefulSet", "trainer"))
    mounts = {m["mountPath"]: m for m in trainer["containers"][0]["volumeMounts"]}
    assert (values["checkpoints"]["mountPath"] in mounts) is values["checkpoints"]["persistence"]["enabled"]
    if values["models"]["persistence"]["enabled"]:
        for comp, kind in (("trainer", "StatefulSet"), ("engine", "Deployment"), ("rollout", "Deployment")):
            mount = next(m for m in pod_spec(one(objects, kind, comp))["containers"][0]["volumeMounts"]
                         if m["name"] == "models")
            assert mount["readOnly"] is True and mount["mountPath"] == values["models"]["mountPath"]


@pytest.mark.parametrize("value_set", ["gpu-cluster"])
def test_service_monitors_select_a_metrics_port(objects):
    monitors = find(objects, "ServiceMonitor")
    assert {component(m) for m in monitors} == {"trainer", "rollout", "router", "engine", "buffer", "reward"}
    for m in monitors:
        services = [s for s in find(objects, "Service")
                    if m["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        ports = {p["name"] for s in services for p in s["spec"]["ports"]}
        for endpoint in m["spec"]["endpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert json.dumps(m["spec"]["namespaceSelector"]) == '{"matchNames": ["rl"]}'
