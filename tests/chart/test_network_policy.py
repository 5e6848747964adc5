"""The chart's NetworkPolicies, per component and port: the exact peers each port admits and each component reaches.

The expected call graph is written out here, apart from the template's: a rule that admits or reaches too much (or
too little) changes a rendered (port, peer) pair and fails. Ports are "<port>/<protocol>" or "any" (a rule without
ports: NCCL and the weight-update group pick their own); peers are a component (this release's pods of it, this
namespace), "cidr:<block>", "anyone" (a rule without peers) or the JSON of an operator's peer.
"""

from __future__ import annotations

import json

import helm_python as helm
import pytest

from tests.chart.chart import VALUE_SETS, find, pod_labels, render, render_raw, rendered, values_of

ANY, ANYONE = "any", "anyone"
Pairs = set[tuple[str, str]]


def selector(component: str) -> dict:
    return {"app.kubernetes.io/name": "physarum", "app.kubernetes.io/instance": "demo",
            "app.kubernetes.io/component": component}


def peer_name(peer: dict) -> str:
    if set(peer) == {"podSelector"}:
        for name in ("buffer", "reward", "rollout", "router", "engine", "trainer", "redis", "fetch"):
            if peer["podSelector"] == {"matchLabels": selector(name)}:
                return name
    if set(peer) == {"ipBlock"} and set(peer["ipBlock"]) == {"cidr"}:
        return f"cidr:{peer['ipBlock']['cidr']}"
    return json.dumps(peer, sort_keys=True)


def port_name(port: dict) -> str:
    return f"{port['port']}/{port.get('protocol', 'TCP')}"


def pairs(rules: list[dict], peers_key: str) -> Pairs:
    """Every (port, peer) a list of ingress ("from") or egress ("to") rules lets through."""
    found: Pairs = set()
    for rule in rules:
        ports = [port_name(p) for p in rule.get("ports", [])] or [ANY]
        peers = [peer_name(p) for p in rule.get(peers_key, [])] or [ANYONE]
        found |= {(port, peer) for port in ports for peer in peers}
    return found


def tcp(*ports: int) -> list[str]:
    return [f"{p}/TCP" for p in ports]


def grant(ports: list[str], peers: list[str]) -> Pairs:
    return {(port, peer) for port in ports for peer in peers}


def expected(values: dict, fetch: bool) -> tuple[dict[str, Pairs], dict[str, Pairs]]:
    """(ingress, egress) pairs per component, from the services' calls (design.md: who calls whom)."""
    v, np = values, values["networkPolicy"]
    trainer = [f"cidr:{c}" for c in np["nodeCIDRs"]] if v["trainer"]["network"]["hostNetwork"] else ["trainer"]
    buffer, reward, rollout = tcp(v["buffer"]["port"]), tcp(v["reward"]["port"]), tcp(v["rollout"]["port"])
    router, engine = tcp(v["router"]["port"]), tcp(v["engines"]["port"])
    job_api = [json.dumps(p, sort_keys=True) for p in np["jobApiFrom"]] or [ANYONE]
    ingress = {
        "buffer": grant(buffer, ["rollout", *trainer]),
        "reward": grant(reward, ["rollout"]),
        "rollout": grant(rollout, trainer),
        "router": grant(router, ["rollout"]),
        "engine": grant(engine, ["rollout", "router"]) | grant([ANY], trainer),
        "trainer": grant([ANY], [*trainer, "engine"])
                   | grant(tcp(v["trainer"]["port"], v["trainer"]["restPort"]), job_api),
    }
    gateway = v["rollout"]["gateway"]
    if gateway["enabled"]:  # agents in other pods reach the rollout manager's agent gateway
        agents = [json.dumps(p, sort_keys=True) for p in gateway["from"]] or [ANYONE]
        ingress["rollout"] |= grant(tcp(gateway["port"]), agents)
    calls = {  # egress besides DNS: what each component calls
        "buffer": set(),
        "reward": set(),
        "rollout": grant(buffer, ["buffer"]) | grant(reward, ["reward"]) | grant(router, ["router"])
                   | grant(engine, ["engine"])
                   | grant(tcp(*np["kubeAPI"]["ports"]), [f"cidr:{c}" for c in np["kubeAPI"]["cidrs"]] or [ANYONE]),
        "router": grant(engine, ["engine"]),
        "engine": grant([ANY], trainer),
        "trainer": grant(buffer, ["buffer"]) | grant(rollout, ["rollout"]) | grant([ANY], ["engine", *trainer]),
    }
    if v["redis"]["enabled"]:
        ingress["redis"] = grant(tcp(6379), ["buffer", *trainer])  # the trainer keeps its job records there
        calls["redis"] = set()
        calls["buffer"] = grant(tcp(6379), ["redis"])
        calls["trainer"] |= grant(tcp(6379), ["redis"])
    if fetch:
        ingress["fetch"], calls["fetch"] = set(), set()
    if v["metrics"]["serviceMonitor"]["enabled"]:
        metrics = {"trainer": v["trainer"]["restPort"], "rollout": v["rollout"]["restPort"],
                   "router": v["router"]["metricsPort"], "buffer": v["buffer"]["metricsPort"],
                   "reward": v["reward"]["restPort"]}
        if v["engines"]["backend"] == "sglang":
            metrics["engine"] = v["engines"]["port"]
        scrapers = [json.dumps(p, sort_keys=True) for p in np["metricsFrom"]]
        for name, port in metrics.items():
            ingress[name] |= grant(tcp(port), scrapers)
    dns = [json.dumps(p, sort_keys=True) for p in np["dns"]]
    egress = {name: c | grant(["53/UDP", "53/TCP"], dns) | pairs(np["extraEgress"].get(name, []), "to")
              for name, c in calls.items()}
    return ingress, egress


ENABLED = [name for name in VALUE_SETS if values_of(name)["networkPolicy"]["enabled"]]


def policies(value_set: str) -> dict[str, dict]:
    found = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p
             for p in find(rendered(value_set), "NetworkPolicy")}
    for name, policy in found.items():
        assert policy["spec"]["podSelector"] == {"matchLabels": selector(name)}, name
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], name
    return found


@pytest.mark.parametrize("value_set", ENABLED)
def test_each_port_admits_exactly_its_callers(value_set):
    fetch = bool(find(rendered(value_set), "Job", "fetch"))
    ingress, _ = expected(values_of(value_set), fetch)
    found = policies(value_set)
    assert set(found) == set(ingress)
    for name, want in ingress.items():
        got = pairs(found[name]["spec"].get("ingress") or [], "from")
        assert got == want, f"{value_set} {name}: admits too much {got - want}, too little {want - got}"


@pytest.mark.parametrize("value_set", ENABLED)
def test_each_component_reaches_exactly_its_peers(value_set):
    fetch = bool(find(rendered(value_set), "Job", "fetch"))
    _, egress = expected(values_of(value_set), fetch)
    found = policies(value_set)
    for name, want in egress.items():
        got = pairs(found[name]["spec"].get("egress") or [], "to")
        assert got == want, f"{value_set} {name}: reaches too much {got - want}, too little {want - got}"


@pytest.mark.parametrize("value_set", ENABLED)
def test_every_pod_has_exactly_one_policy(value_set):
    objects = rendered(value_set)
    pods = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    assert pods
    for pod in pods:
        selecting = [p for p in find(objects, "NetworkPolicy")
                     if p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(pod).items()]
        assert len(selecting) == 1, pod["metadata"]["name"]


@pytest.mark.parametrize("value_set", sorted(set(VALUE_SETS) - set(ENABLED)))
def test_disabled_renders_no_policy(value_set):
    assert not find(rendered(value_set), "NetworkPolicy")


def test_host_network_trainer_is_its_nodes_addresses():
    """With the trainer on the node's network, its peers admit and the engines reach the node CIDRs, not pods."""
    found = policies("host-network")
    cidrs = {f"cidr:{c}" for c in values_of("host-network")["networkPolicy"]["nodeCIDRs"]}
    assert cidrs
    for name in ("buffer", "rollout", "engine"):
        peers = {peer for _, peer in pairs(found[name]["spec"]["ingress"], "from")}
        assert cidrs <= peers and "trainer" not in peers, name
    assert {peer for _, peer in pairs(found["engine"]["spec"]["egress"], "to")} >= cidrs


def test_only_the_fetch_jobs_reach_anywhere():
    """Out of the box nothing but the fetch Jobs leaves the cluster (besides the rollout manager's Kubernetes API)."""
    found = policies("gpu-cluster")  # fetches the model and the datasets
    assert ("443/TCP", ANYONE) in pairs(found["fetch"]["spec"]["egress"], "to")
    for name in ("buffer", "reward", "router", "engine", "trainer", "redis"):
        assert all(peer != ANYONE for _, peer in pairs(found[name]["spec"]["egress"], "to")), name


@pytest.mark.parametrize(("values", "message"), [
    ({"networkPolicy": {"kubeAPI": {"ports": []}}}, r"kubeAPI/ports"),
    ({"networkPolicy": {"dns": []}}, r"networkPolicy/dns"),
    ({"networkPolicy": {"extraEgress": {"engines": []}}}, r"engines"),
    ({"networkPolicy": {"extraEgress": {"reward": [{"too": []}]}}}, r"too"),
])
def test_schema_refuses_bad_policy_values(values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render_raw(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"enabled": False, "externalUrl": "redis://redis.data:6379/0"}}, r"networkPolicy.extraEgress.buffer"),
    ({"redis": {"enabled": False, "externalUrl": "redis://redis.data:6379/0"},
      "networkPolicy": {"extraEgress": {"buffer": [{"ports": [{"port": 6379}]}]}}},
     r"networkPolicy.extraEgress.trainer"),
    ({"checkpoints": {"objectStore": {"endpoint": "https://s3.example.com"}}}, r"networkPolicy.extraEgress.trainer"),
])
def test_guards_refuse_an_external_peer_without_its_egress(values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)
    allowed = {"networkPolicy": {"extraEgress": {"buffer": [{"ports": [{"port": 6379}]}],
                                                 "trainer": [{"ports": [{"port": 443}]}]}}}
    assert find(render({**values, **allowed}), "NetworkPolicy")


def test_extra_egress_lands_on_its_component_only():
    rule = {"to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    for policy in find(render({"networkPolicy": {"extraEgress": {"reward": [rule]}}}), "NetworkPolicy"):
        has = rule in policy["spec"]["egress"]
        assert has == (policy["metadata"]["labels"]["app.kubernetes.io/component"] == "reward")
