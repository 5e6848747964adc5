"""The agent gateway on the chart: off, the rollout Service has no gateway port and the manager picks its own; on,
the Service and the container carry the port, the sessions' base URL names the Service (or the given URL), and the
NetworkPolicy admits the listed agent pods on it (tests/chart/test_network_policy.py checks the whole graph)."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart.chart import NAMESPACE, container_ports, containers, env_of, find, render, rendered

ROLLOUT_SERVICE = "demo-physarum-rollout"


def rollout(objects: list[dict]) -> tuple[dict, dict]:
    [service] = [s for s in find(objects, "Service", "rollout") if s["metadata"]["name"] == ROLLOUT_SERVICE]
    [deployment] = find(objects, "Deployment", "rollout")
    return service, containers(deployment)[0]


def test_gateway_is_off_by_default():
    service, container = rollout(list(rendered("default")))
    assert "gateway" not in {p["name"] for p in service["spec"]["ports"]}
    assert "gateway" not in container_ports(container)
    assert not {"PHYSARUM_ROLLOUT_GATEWAY_PORT", "PHYSARUM_ROLLOUT_GATEWAY_URL"} & set(env_of(container))


def test_gateway_port_reaches_agents_in_other_pods():
    service, container = rollout(list(rendered("agent-gateway")))
    [port] = [p for p in service["spec"]["ports"] if p["name"] == "gateway"]
    assert (port["port"], port["targetPort"], container_ports(container)["gateway"]) == (8090, "gateway", 8090)
    env = env_of(container)
    assert env["PHYSARUM_ROLLOUT_GATEWAY_PORT"]["value"] == "8090"
    assert env["PHYSARUM_ROLLOUT_GATEWAY_URL"]["value"] == f"http://{ROLLOUT_SERVICE}.{NAMESPACE}.svc:8090/v1"
    [policy] = find(rendered("agent-gateway"), "NetworkPolicy", "rollout")
    [rule] = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": 8090, "protocol": "TCP"}]]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "calculator-agent"}}}]


def test_a_given_url_is_handed_to_agents_as_is():
    url = "https://agents.example.com/v1"
    _, container = rollout(render({"rollout": {"gateway": {"enabled": True, "url": url}}}))
    assert env_of(container)["PHYSARUM_ROLLOUT_GATEWAY_URL"]["value"] == url


@pytest.mark.parametrize("values", [
    {"rollout": {"gateway": {"enabled": True, "url": "http://agents.example.com"}}},  # not ending in /v1
    {"rollout": {"gateway": {"enabled": True, "port": 0}}},
    {"rollout": {"config": {"gateway_port": 9000}}},  # the chart sets it from rollout.gateway
])
def test_schema_refuses_bad_gateway_values(values):
    with pytest.raises(helm.HelmValuesError):
        render(values)
