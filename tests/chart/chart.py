"""Render the Helm chart in-process with the real Helm SDK (helm-python-sdk), offline, once per value set.

VALUE_SETS: the chart's defaults ("default") plus every deploy/helm/ci/<name>.yaml. `rendered(name)` returns the
parsed objects of that set, rendered as release "demo" in namespace "rl".
"""

from __future__ import annotations

import functools
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "physarum"
CI_DIR = ROOT / "deploy" / "helm" / "ci"
RELEASE, NAMESPACE = "demo", "rl"

VALUE_SETS: dict[str, dict] = {"default": {}}
VALUE_SETS.update({p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted(CI_DIR.glob("*.yaml"))})


def parse(manifests: dict[str, str]) -> list[dict]:
    """Every object of a render, YAML-parsed (render() itself lets broken YAML through); NOTES.txt left out."""
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        try:
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        except yaml.YAMLError as err:
            raise AssertionError(f"{path} renders invalid YAML: {err}\n{text}") from err
    return objects


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(str(CHART))


def render_raw(values: dict, *, release: str = RELEASE, chart_dir: Path = CHART) -> dict[str, str]:
    """Template path -> rendered text; raises helm.HelmValuesError (schema) or helm.HelmRenderError (guards)."""
    chart = _chart() if chart_dir == CHART else helm.Chart.load(str(chart_dir))
    return chart.render(values, name=release, namespace=NAMESPACE, is_install=True)


def render(values: dict, *, release: str = RELEASE) -> list[dict]:
    return parse(render_raw(values, release=release))


@functools.cache
def rendered(value_set: str) -> tuple[dict, ...]:
    return tuple(render(VALUE_SETS[value_set]))


def find(objects, kind: str, component: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind
            and (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]


def one(objects, kind: str, component: str) -> dict:
    found = find(objects, kind, component)
    assert len(found) == 1, f"expected one {kind} of component {component}, found {len(found)}"
    return found[0]


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def values_of(value_set: str) -> dict:
    """The chart's merged values (defaults + the set's overrides)."""
    return _chart().merge_values(VALUE_SETS[value_set])
