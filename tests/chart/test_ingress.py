"""The optional Ingress of the job API and its dashboard: off by default; on, every path of its host goes to the
trainer's job API Service on the REST port, with TLS when a Secret is named."""

from __future__ import annotations

from tests.chart.chart import find, one, rendered


def test_no_ingress_by_default():
    assert find(rendered("default"), "Ingress") == []


def test_the_ingress_routes_its_host_to_the_job_api_service_over_tls():
    objects = rendered("external-redis")
    ingress = one(objects, "Ingress", "trainer")["spec"]
    service = next(s for s in find(objects, "Service", "trainer") if not s["metadata"]["name"].endswith("-headless"))
    (rule,) = ingress["rules"]
    (path,) = rule["http"]["paths"]
    assert (rule["host"], path["path"], path["pathType"]) == ("physarum.ml.example.com", "/", "Prefix")
    assert path["backend"]["service"] == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"} in service["spec"]["ports"]
    assert ingress["tls"] == [{"hosts": ["physarum.ml.example.com"], "secretName": "physarum-tls"}]
    assert ingress["ingressClassName"] == "nginx"
