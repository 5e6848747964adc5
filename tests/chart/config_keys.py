"""The `<component>.config` keys values.schema.json admits: the fields of each service's config dataclass, less those
the chart sets itself (refused with `false`), so that a typo fails at render instead of becoming a variable the
service would refuse at start. Run as a script to rewrite the schema's lists after a config class changes:

    .venv/bin/python -m tests.chart.config_keys
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "deploy" / "helm" / "physarum" / "values.schema.json"
# values key -> (service, the fields the chart sets from its own values); engines.cpu.config is the CPU engine's
COMPONENTS = {
    "buffer": ("buffer", {"host", "port", "redis_url", "metrics_port", "data_roots"}),
    "reward": ("reward", {"host", "port", "rest_port"}),
    "rollout": ("rollout", {"host", "port", "rest_port", "buffer_addr", "reward_addr", "router_url", "router_policy",
                            "model_path", "engine_launcher", "k8s_namespace", "k8s_engine_deployment",
                            "k8s_engine_selector", "k8s_engine_port", "num_engines", "engine_join_mode",
                            "weight_snapshot_dir", "gateway_port", "gateway_url"}),
    "engines.cpu": ("engine", {"host", "port", "model_path", "served_model_name"}),
    "trainer": ("trainer", {"host", "port", "rest_port", "buffer_addr", "rollout_addr", "master_address",
                            "default_train_backend", "api_token", "dist_backend", "world_size", "rank", "data_roots",
                            "checkpoint_roots", "export_roots", "jobs_redis_url",
                            "preempt_timeout_s"}),
}
VALUE = {"anyOf": [{"type": ["string", "number", "boolean"]},
                   {"type": "array", "items": {"type": ["string", "number", "boolean"]}}]}


def config_classes() -> dict[str, type]:
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["config_table"] = module
    spec.loader.exec_module(module)
    return {s.name: s.config_cls for s in module.discover()}


def config_schema(service: str, chart_set: set[str], cls: type) -> dict:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    missing = chart_set - set(fields)
    assert not missing, f"{service}: the chart sets {sorted(missing)}, which are no fields of {cls.__name__}"
    properties: dict = {name: False for name in sorted(chart_set)}
    for name in sorted(set(fields) - chart_set):
        properties[name] = {**VALUE, "description": fields[name].metadata.get("help", "")}
    return {
        "type": "object",
        "description": f"PHYSARUM_{service.upper()}_<FIELD> settings, keyed by the field names of {cls.__name__}; "
                       f"the chart sets {', '.join(sorted(chart_set))} itself; any other key is refused",
        "properties": properties,
        "additionalProperties": False,
    }


def node(schema: dict, component: str) -> dict:
    for part in component.split("."):
        schema = schema["properties"][part]
    return schema


def expected(schema: dict) -> dict:
    classes = config_classes()
    return {component: config_schema(service, chart_set, classes[service])
            for component, (service, chart_set) in COMPONENTS.items()}


def main() -> None:
    schema = json.loads(SCHEMA.read_text())
    for component, config in expected(schema).items():
        node(schema, component)["properties"]["config"] = config
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    main()
