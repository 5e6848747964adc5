"""GPU-cluster conventions on every rendered value set: GPU limits, /dev/shm, probes, non-root,
resources, PDBs, the trainer's headless Service and rank discovery, selectors, NCCL/gloo interfaces, hostNetwork DNS."""

from __future__ import annotations

from tests.chart.chart import (
    NAMESPACE,
    component,
    container_ports,
    containers,
    env_of,
    find,
    one,
    pod_labels,
    pod_spec,
    values_of,
    workloads,
)

GPU_COMPONENTS = ("trainer", "engine")
POD_INDEX = "apps.kubernetes.io/pod-index"


def gpus_of(values: dict, comp: str) -> int:
    if comp == "trainer":
        return values["trainer"]["gpus"]
    return values["engines"]["gpus"] if values["engines"]["backend"] == "sglang" else 0


def test_gpu_limits(objects, value_set):
    values = values_of(value_set)
    gpu = values["gpuResourceName"]
    for w in workloads(objects):
        for c in containers(w):
            limits, requests = c["resources"].get("limits", {}), c["resources"].get("requests", {})
            expected = gpus_of(values, component(w)) if component(w) in GPU_COMPONENTS else 0
            assert limits.get(gpu, 0) == expected, (w["metadata"]["name"], limits)
            assert isinstance(limits.get(gpu, 0), int)
            assert requests.get(gpu, expected) == expected  # requests of an extended resource equal its limits


def test_gpu_pods_tolerate_the_gpu_taint_by_default(value_set, objects):
    if value_set != "default":
        return
    for comp in GPU_COMPONENTS:
        w = next(w for w in workloads(objects) if component(w) == comp)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(w)["tolerations"]


def test_dev_shm_is_a_sized_memory_emptydir(objects, value_set):
    values = values_of(value_set)
    sizes = {"trainer": values["trainer"]["shmSize"], "engine": values["engines"]["shmSize"]}
    for w in workloads(objects):
        if component(w) not in GPU_COMPONENTS:
            continue
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        for c in containers(w):
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
            empty_dir = volumes[mount["name"]]["emptyDir"]
            assert empty_dir["medium"] == "Memory"  # exact case: the API server rejects "memory", the schema does not
            assert empty_dir["sizeLimit"] == sizes[component(w)]


def test_every_container_has_three_probes_on_declared_numeric_ports(objects):
    for w in workloads(objects):
        for c in containers(w):
            ports = set(container_ports(c).values())
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                handler = next(probe[k] for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in probe)
                if "port" in handler:
                    assert isinstance(handler["port"], int), (c["name"], kind)  # grpc probes refuse named ports
                    assert handler["port"] in ports, (c["name"], kind, handler["port"])


def test_grpc_services_use_grpc_health_probes(objects):
    names = set()
    for w in workloads(objects):
        for c in containers(w):
            if "grpc" not in container_ports(c):
                continue
            names.add(c["name"])
            port = container_ports(c)["grpc"]
            if component(w) == "trainer":  # exec probes: only rank 0 serves (test_trainer_probes runs them)
                script = c["readinessProbe"]["exec"]["command"][2]
                assert f'grpc.insecure_channel("127.0.0.1:{port}")' in script and "HealthStub" in script
                continue
            assert c["startupProbe"]["grpc"] == {"port": port}, c["name"]
            assert c["readinessProbe"]["grpc"] == {"port": port}, c["name"]
            assert c["livenessProbe"]["tcpSocket"] == {"port": port}, c["name"]  # a dependency outage must not restart
    assert names == {"buffer", "reward", "rollout", "trainer"}


def test_engine_and_router_probe_their_health_endpoints(objects):
    engine = one(workloads(objects), "Deployment", "engine")["spec"]["template"]["spec"]["containers"][0]
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 600  # model load
    router = one(workloads(objects), "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_pods_run_as_non_root_without_privileges(objects):
    for w in workloads(objects):
        pod_ctx = pod_spec(w)["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True, w["metadata"]["name"]
        assert pod_ctx["runAsUser"] != 0
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(w):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, c["name"]
            assert ctx.get("privileged", False) is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert ctx["readOnlyRootFilesystem"] is True


def test_read_only_root_gets_a_writable_tmp(objects):
    for w in workloads(objects):
        if component(w) == "redis":
            continue  # writes only /data
        for c in containers(w):
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), c["name"]
            assert env_of(c)["HOME"]["value"] == "/tmp"


def test_every_container_requests_cpu_and_memory_and_limits_memory(objects):
    for w in workloads(objects):
        for c in containers(w):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]


def test_shm_fits_in_the_memory_limit(objects, value_set):
    """A memory emptyDir counts against the pod's memory: its sizeLimit must not exceed the containers' limits."""
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}

    def mib(q: str) -> int:
        return int(q[:-2]) * units[q[-2:]]

    for w in workloads(objects):
        shm = [v for v in pod_spec(w).get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
        if shm:
            limit = sum(mib(c["resources"]["limits"]["memory"]) for c in containers(w))
            assert mib(shm[0]["emptyDir"]["sizeLimit"]) <= limit, w["metadata"]["name"]


def test_trainer_has_a_pdb_blocking_voluntary_disruption(objects):
    pdb = one(objects, "PodDisruptionBudget", "trainer")
    sts = one(objects, "StatefulSet", "trainer")
    assert pdb["spec"]["maxUnavailable"] == 0
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(sts).items()


def test_engine_pdb_follows_values(objects, value_set):
    values = values_of(value_set)["engines"]["pdb"]
    pdbs = find(objects, "PodDisruptionBudget", "engine")
    assert len(pdbs) == (1 if values["enabled"] else 0)
    if pdbs:
        assert pdbs[0]["spec"]["maxUnavailable"] == values["maxUnavailable"]


def test_trainer_statefulset_discovers_ranks_through_a_headless_service(objects, value_set):
    values = values_of(value_set)["trainer"]
    sts = one(objects, "StatefulSet", "trainer")
    services = {s["metadata"]["name"]: s for s in find(objects, "Service", "trainer")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["replicas"] == values["replicas"]

    env = env_of(pod_spec(sts)["containers"][0])
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{POD_INDEX}']"
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{POD_INDEX}']"
    assert env["NUM_PODS"]["value"] == str(values["replicas"])
    assert env["NPROC_PER_POD"]["value"] == str(max(1, values["gpus"]))  # one rank per GPU
    assert env["WORLD_SIZE"]["value"] == str(values["replicas"] * max(1, values["gpus"]))
    rank0 = f"{sts['metadata']['name']}-0.{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert env["MASTER_ADDR"]["value"] == rank0
    assert env["MASTER_PORT"]["value"] == str(values["distPort"])
    assert env["PHYSARUM_TRAINER_MASTER_ADDRESS"]["value"] == rank0  # engines join rank 0's weight-update group


def test_job_api_service_routes_to_rank_zero(objects):
    api = next(s for s in find(objects, "Service", "trainer") if s["spec"].get("clusterIP") != "None")
    assert api["spec"]["selector"][POD_INDEX] == "0"
    assert {p["name"] for p in api["spec"]["ports"]} == {"http", "grpc"}


def test_selectors_match_pod_labels(objects):
    pods = {w["metadata"]["name"]: w for w in workloads(objects)}
    for w in pods.values():
        assert w["spec"]["selector"]["matchLabels"].items() <= pod_labels(w).items(), w["metadata"]["name"]
    for svc in find(objects, "Service"):
        selector = dict(svc["spec"]["selector"])
        if selector.pop(POD_INDEX, None) is not None:  # set on StatefulSet pods by the controller, not the template
            assert component(svc) == "trainer"
        targets = [w for w in pods.values() if selector.items() <= pod_labels(w).items()]
        assert len(targets) == 1, svc["metadata"]["name"]
        ports = {n for c in containers(targets[0]) for n in container_ports(c)}
        ports |= {p for c in containers(targets[0]) for p in container_ports(c).values()}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)


def test_nccl_and_gloo_use_the_same_interface(objects):
    seen = 0
    for w in workloads(objects):
        for c in containers(w):
            env = env_of(c)
            if "NCCL_SOCKET_IFNAME" in env or "GLOO_SOCKET_IFNAME" in env:
                assert env["NCCL_SOCKET_IFNAME"]["value"] == env["GLOO_SOCKET_IFNAME"]["value"], c["name"]
                seen += 1
    assert seen == 2  # the trainer and the engines (the two ends of the weight-update group)


def test_nccl_debug_is_opt_in(objects, value_set):
    env = env_of(pod_spec(one(objects, "StatefulSet", "trainer"))["containers"][0])
    level = values_of(value_set)["trainer"]["network"]["ncclDebug"]
    assert env.get("NCCL_DEBUG", {}).get("value", "") == level


def test_host_network_uses_cluster_dns(objects):
    for w in workloads(objects):
        spec = pod_spec(w)
        if spec.get("hostNetwork"):
            assert spec["dnsPolicy"] == "ClusterFirstWithHostNet", w["metadata"]["name"]
        else:
            assert "hostIPC" not in spec or component(w) == "trainer"


def test_host_network_is_opt_in(objects, value_set):
    spec = pod_spec(one(objects, "StatefulSet", "trainer"))
    network = values_of(value_set)["trainer"]["network"]
    assert spec.get("hostNetwork", False) is network["hostNetwork"]
    assert spec.get("hostIPC", False) is network["hostIPC"]
    assert not any(pod_spec(w).get("hostNetwork") for w in workloads(objects) if component(w) != "trainer")


def test_stateless_services_spread_over_nodes(objects, value_set):
    values = values_of(value_set)
    for comp in ("buffer", "reward"):
        w = one(objects, "Deployment", comp)
        constraints = pod_spec(w).get("topologySpreadConstraints", [])
        assert len(constraints) == len(values[comp]["topologySpreadConstraints"])
        for c in constraints:
            assert c["labelSelector"]["matchLabels"].items() <= pod_labels(w).items()


def test_pods_restart_when_the_secret_they_read_changes(objects):
    for w in workloads(objects):
        if component(w) == "redis":  # its password is generated once and kept: a restart would only cost a replay
            continue
        keys = ("api-token", "redis-url", "redis-password")
        reads_secret = any(e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") in keys
                           for c in containers(w) for e in c.get("env", []))
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        # readers restart on a change; the others (GPU engines above all) must not
        assert ("checksum/secret" in annotations) is reads_secret, w["metadata"]["name"]


def test_engines_roll_without_needing_spare_gpus(objects):
    strategy = one(objects, "Deployment", "engine")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxSurge"] == 0


def test_singletons_replace_rather_than_overlap(objects):
    for comp in ("rollout", "router"):
        d = one(objects, "Deployment", comp)
        assert d["spec"]["replicas"] == 1
        assert d["spec"]["strategy"]["type"] == "Recreate"
