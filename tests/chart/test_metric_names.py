"""Every metric a dashboard panel, the dashboards' variables or an engine HPA names is one the code exports, under its
real name: Physarum's from the services' own registries (and the trainer's gauges from the step-metric keys its code
writes), SGLang's from the names its metrics collector registers (its image exports them with --enable-metrics)."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import REGISTRY

from services.buffer.metrics import BufferMetrics
from services.reward.metrics import RewardMetrics
from services.rollout.gateway.metrics import GatewayMetrics
from services.rollout.pool.metrics import PoolMetrics
from services.trainer.driver import metrics as trainer_metrics
from tests.chart.chart import CHART, ROOT, VALUE_SETS, find, render, values_of

# SGLang's scheduler metrics, under the names its metrics collector registers them (its /metrics with --enable-metrics)
SGLANG = {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:gen_throughput", "sglang:token_usage",
          "sglang:cache_hit_rate"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "le", "inf", "nan"}
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))


def exported() -> set[str]:
    """Every series name the code can export: families and their samples (_total, _bucket, _sum, _count)."""
    names = set(SGLANG)
    registries = [BufferMetrics().registry, RewardMetrics().registry, PoolMetrics().registry,
                  GatewayMetrics().registry, REGISTRY]
    for registry in registries:
        for family in registry.collect():  # a labelled family has no samples before its first use
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names |= {family.name + suffix for suffix in suffixes} | {s.name for s in family.samples}
    keys = set()
    for path in (ROOT / "services" / "trainer").rglob("*.py"):  # the step metrics the trainer's gauges mirror
        keys |= set(re.findall(r"\"((?:train|rollout|perf|eval)/[a-z0-9_]+)\"", path.read_text()))
    return names | {trainer_metrics.prometheus_name(k) for k in keys}


EXPORTED = exported()


def metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression: identifiers that are no function, keyword or label."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)   # label matchers, ranges, strings
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)  # grouping label lists
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?![a-zA-Z0-9_:]*\s*\()", bare))
    return {n for n in names if n.lower() not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", n)}


def dashboard_expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            metric = re.fullmatch(r"label_values\(([^,]+),\s*\w+\)", var["query"])
            assert metric, f"templating query {var['query']!r}: expected label_values(metric, label)"
            exprs.append(metric[1])
    return exprs


def test_the_name_extraction_finds_what_a_query_reads():
    expr = 'histogram_quantile(0.95, sum by (le, scorer) (rate(physarum_reward_score_seconds_bucket{a="b"}[5m])))'
    assert metric_names(expr) == {"physarum_reward_score_seconds_bucket"}
    assert metric_names('sum(sglang:num_queue_reqs{pod=~"x"}) / sum(up)') == {"sglang:num_queue_reqs", "up"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_every_dashboard_expression_names_an_exported_metric(path):
    dashboard = json.loads(path.read_text())
    exprs = dashboard_expressions(dashboard)
    assert len(exprs) >= 10
    for expr in exprs:
        names = metric_names(expr)
        assert names and names <= EXPORTED, (expr, names - EXPORTED)


def test_dashboards_ship_in_a_configmap_with_the_sidecar_label():
    objects = render({"metrics": {"grafanaDashboards": {"enabled": True}}})
    (configmap,) = [c for c in find(objects, "ConfigMap") if c["metadata"]["name"].endswith("-dashboards")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(configmap["data"]) == [p.name for p in DASHBOARDS]
    assert all(json.loads(text)["uid"] for text in configmap["data"].values())
    assert not [c for c in find(render({}), "ConfigMap") if c["metadata"]["name"].endswith("-dashboards")]


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_hpa_metric_is_exported_under_its_real_name(value_set):
    hpas = [h for h in find(render(VALUE_SETS[value_set]), "HorizontalPodAutoscaler")
            if h["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    assert len(hpas) == int(values_of(value_set)["engines"]["hpa"]["enabled"])
    for hpa in hpas:
        for metric in hpa["spec"]["metrics"]:
            source = metric[{"Pods": "pods", "External": "external", "Object": "object"}[metric["type"]]]
            assert source["metric"]["name"] in EXPORTED, source["metric"]["name"]
