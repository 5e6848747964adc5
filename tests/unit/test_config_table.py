"""The docs' Configuration table (docs/configuration.md) and job-spec table (docs/jobs.md): generated from the config
classes, current, and true (each variable is read)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from services.buffer.config import BufferConfig
from services.common.config import REQUIRED, env_name, field, load_config, shared

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


config_table = load_script("config_table")
SERVICES = config_table.discover()


def test_configuration_table_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert "# Configuration" in doc
    assert config_table.replace_table(doc, config_table.render(SERVICES)) == doc, (
        "docs/configuration.md's Configuration table is stale: run .venv/bin/python scripts/config_table.py")


def test_every_service_main_is_found_with_its_config_class():
    mains = sorted((ROOT / "services").rglob("__main__.py"))
    assert len(SERVICES) == len(mains) >= 5
    by_module = {s.module: s for s in SERVICES}
    assert by_module["services.buffer"].name == "buffer" and by_module["services.buffer"].config_cls is BufferConfig
    assert by_module["services.engine"].name == "engine"


def test_a_service_that_bypasses_load_config_is_an_error(tmp_path):
    (tmp_path / "services" / "rogue").mkdir(parents=True)
    (tmp_path / "services" / "rogue" / "__main__.py").write_text("import os\nPORT = os.environ['ROGUE_PORT']\n")
    with pytest.raises(ValueError, match=r"services/rogue/__main__.py: no load_config\(ConfigClass"):
        config_table.discover(tmp_path)


def required_args(service, tmp_path) -> list[str]:
    """Flags a config cannot do without (the engine needs a model directory)."""
    if service.name == "engine":
        (tmp_path / "config.json").write_text("{}")
        return ["--model-path", str(tmp_path)]
    return []


@pytest.mark.parametrize("service", SERVICES, ids=[s.name for s in SERVICES])
def test_each_listed_variable_is_read_and_its_default_text_parses_back(service, tmp_path, monkeypatch):
    argv = required_args(service, tmp_path)
    expected = load_config(service.config_cls, service.name, argv)
    for row in config_table.rows(service):
        variable, default = row[2].strip("`"), row[3]
        monkeypatch.setenv(variable, "" if default == "(empty)" else default.strip("`"))
    assert load_config(service.config_cls, service.name, argv) == expected
    monkeypatch.setenv(env_name(service.name, "port"), "4321")
    assert load_config(service.config_cls, service.name, argv).port == 4321
    assert load_config(service.config_cls, service.name, [*argv, "--port", "4322"]).port == 4322  # flag beats env


def test_rows_render_flags_variables_defaults_and_escape_pipes():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class DemoConfig:
        peer_urls: list[str] = field(["http://a:1", "http://b:2"], "peers | comma-separated")
        verbose: bool = field(False, "log more")
        name: str = field("", "optional name")

    service = config_table.Service("demo", "services.demo", DemoConfig)
    assert config_table.rows(service) == [
        ["`services.demo`", "`--peer-urls`", "`PHYSARUM_DEMO_PEER_URLS`", "`http://a:1,http://b:2`",
         "peers \\| comma-separated"],
        ["`services.demo`", "`--verbose`", "`PHYSARUM_DEMO_VERBOSE`", "`false`", "log more"],
        ["`services.demo`", "`--name`", "`PHYSARUM_DEMO_NAME`", "(empty)", "optional name"],
    ]


def test_job_spec_table_is_current():
    doc = (ROOT / "docs" / "jobs.md").read_text()
    table = config_table.render_spec(config_table.job_parts())
    assert config_table.replace_table(doc, table, config_table.SPEC_BEGIN, config_table.SPEC_END) == doc, (
        "docs/jobs.md's job-spec table is stale: run .venv/bin/python scripts/config_table.py")
    assert all(path.read_text() == text for path, text in config_table.current_docs().items())


def test_job_spec_rows_name_the_part_mark_required_keys_and_skip_shared_ones():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class PartA:
        size: int = field(REQUIRED, "how many | at least one")
        name: str = field("x", "a name")
        secret: str = field("", "set by code", internal=True)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class PartB:
        size: int = shared(PartA, "size")
        tags: list[str] = field(["a"], "tags")

    assert config_table.spec_rows([PartA, PartB]) == [
        ["`size`", "PartA", "required", "how many \\| at least one"],
        ["`name`", "PartA", "`'x'`", "a name"],
        ["`tags`", "PartB", "`['a']`", "tags"],
    ]


def test_an_unknown_service_variable_is_refused_by_name_with_the_closest_field(monkeypatch, capsys):
    monkeypatch.setenv("PHYSARUM_BUFFER_REDIS_ULR", "redis://x:1/0")
    monkeypatch.setenv("PHYSARUM_REWARD_ANYTHING", "1")  # another service's prefix: not the buffer's business
    with pytest.raises(SystemExit) as exit_info:
        load_config(BufferConfig, "buffer", [])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown variable PHYSARUM_BUFFER_REDIS_ULR (did you mean PHYSARUM_BUFFER_REDIS_URL?)" in err
    assert "REWARD" not in err
    monkeypatch.delenv("PHYSARUM_BUFFER_REDIS_ULR")
    assert load_config(BufferConfig, "buffer", []).port == BufferConfig().port
def test_config_logs_redact_secrets():
    from services.common.config import redacted

    config = {"api_token": "s3cr3t", "redis_url": "redis://user:pw@10.0.0.1:6379/0", "engine_per_token_delay_s": 0.5,
              "nested": {"password": "x", "peers": ["rediss://:pw@h:1"]}, "empty_token": ""}
    assert redacted(config) == {"api_token": "***", "redis_url": "redis://***@10.0.0.1:6379/0",
                                "engine_per_token_delay_s": 0.5, "nested": {"password": "***",
                                                                            "peers": ["rediss://***@h:1"]},
                                "empty_token": ""}
