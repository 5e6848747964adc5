"""The chart lints clean (strict) and renders, for the defaults and every deploy/helm/ci/*.yaml, into objects that
pass the Kubernetes OpenAPI schemas strictly (misspelt fields fail) on the oldest and newest supported versions."""

from __future__ import annotations

import functools
import json
import re

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from tests.chart.chart import CHART, NAMESPACE, VALUE_SETS, find, render, render_raw

KUBE_VERSIONS = ("1.28.0", "1.37.0")  # Chart.yaml kubeVersion >=1.28 (the pod-index label); the newest schemas bundled
CRD_KINDS = {"ServiceMonitor"}  # no bundled schema: test_conventions checks their structure


@pytest.fixture(scope="module", autouse=True)
def cached_kubernetes_schemas():
    """kubernetes-validate re-reads its schema files (a 2 MB definitions file) for every object: read each once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kubernetes_validate.utils, "schema_contents",
                      functools.cache(kubernetes_validate.utils.schema_contents))
        yield


def test_ci_value_sets_exist():
    assert {"gpu-cluster", "external-redis", "hpa-engines", "minimal"} <= set(VALUE_SETS)


def test_lint_strict(value_set):
    report = helm.lint(str(CHART), VALUE_SETS[value_set], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert serious == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_objects_pass_kubernetes_schemas_strictly(objects, kube_version):
    failures = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']} at {list(err.path)}: {err.message}")
    assert failures == []


def test_strict_validation_catches_a_misspelt_field(objects):
    """The check above is not vacuous: one typo in a rendered Deployment fails it."""
    deployment = dict(find(objects, "Deployment")[0])
    deployment["spec"] = {**deployment["spec"], "replcas": 2}
    with pytest.raises(kubernetes_validate.ValidationError, match="replcas"):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


def test_every_object_is_namespaced_and_labelled(objects):
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == NAMESPACE, meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "demo", meta["name"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm", meta["name"]
        assert meta["labels"]["app.kubernetes.io/part-of"] == "physarum", meta["name"]


def test_object_names_are_unique(objects):
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))


def test_names_fit_63_characters_with_a_long_release_name():
    release = "a-very-long-release-name-for-a-reinforcement-learning-run"  # 57 characters
    fetching = {"model": {"source": "hf", "hf": {"repo": "a/b"}}, "datasets": {"source": "s3", "s3": {"uri": "s3://b"}},
                "metrics": {"grafanaDashboards": {"enabled": True}}}  # the optional objects too
    for obj in render({}, release=release) + render(fetching, release=release):
        name = obj["metadata"]["name"]
        assert len(name) <= 63, name
        if obj["kind"] == "StatefulSet":  # pod "<name>-<ordinal>" and label controller-revision-hash "<name>-<10>"
            assert len(name) + 11 <= 63, name


def test_default_render_has_one_workload_per_service():
    objects = render({})
    kinds = {(o["kind"], o["metadata"]["labels"]["app.kubernetes.io/component"]) for o in objects}
    assert {("StatefulSet", "trainer"), ("StatefulSet", "redis"), ("Deployment", "engine"), ("Deployment", "router"),
            ("Deployment", "rollout"), ("Deployment", "buffer"), ("Deployment", "reward")} <= kinds


def test_notes_tell_how_to_submit_a_job():
    notes = render_raw({})["physarum/templates/NOTES.txt"]
    assert "physarum submit job.yaml --url http://127.0.0.1:8080" in notes
    assert "curl -X POST http://127.0.0.1:8080/v1/jobs" in notes
    assert "port-forward svc/demo-physarum-trainer 8080:8080" in notes
    assert "get secret demo-physarum" in notes


def test_notes_example_job_is_a_valid_spec():
    from services.trainer.api.spec import parse_spec  # torch-free

    notes = render_raw({})["physarum/templates/NOTES.txt"]
    body = json.loads(re.search(r"-d '(\{.*?\})'", notes, re.S).group(1))
    spec = parse_spec(body)
    assert spec.hf_checkpoint == "/models/model" and spec.save == "/checkpoints/run1"


def test_chart_requires_kubernetes_with_the_pod_index_label():
    """RANK comes from apps.kubernetes.io/pod-index, set on StatefulSet pods since 1.28 (gRPC probes: GA 1.27)."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.28.0-0"
    assert min(KUBE_VERSIONS) == "1.28.0"
