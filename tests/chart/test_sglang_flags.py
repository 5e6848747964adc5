"""The flags Physarum passes to SGLang's `launch_server` are flags of the SGLang release the chart pins: the chart's
engine args (with the gpu-cluster value set's extraArgs), the local launcher's fixed ones and the admin-key flag.

tests/data/sglang_server_flags.json is read from the sglang wheel of that release by scripts/sglang_server_flags.py
(SGLang itself cannot be imported without CUDA kernels); a new pin in values.yaml needs the file written again.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from services.rollout.pool.keyed_launch import FLAGS as KEY_FLAGS
from services.rollout.pool.sglang_launcher import sglang_server_argv
from tests.chart.chart import CHART, rendered

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_server_flags.json").read_text())
SGLANG_FLAGS = set(DATA["flags"])


def flag_names(argv: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]


def test_the_flag_list_is_of_the_pinned_release():
    pinned = yaml.safe_load((CHART / "values.yaml").read_text())["engines"]["sglang"]["image"]["tag"]
    assert pinned == f"v{DATA['sglang_version']}"
    assert len(SGLANG_FLAGS) > 300 and "--model-path" in SGLANG_FLAGS  # the whole server, not a fragment


def test_the_charts_engine_args_are_launch_server_flags():
    (engine,) = [o for o in rendered("gpu-cluster") if o["kind"] == "Deployment"
                 and o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    container = engine["spec"]["template"]["spec"]["containers"][0]
    assert "sglang.launch_server" in " ".join(container["command"])
    names = flag_names(container["args"])
    assert {"--model-path", "--tp-size", "--mem-fraction-static", "--enable-memory-saver"} <= set(names)
    assert [n for n in names if n not in SGLANG_FLAGS] == []


def test_the_local_launcher_and_the_admin_key_use_launch_server_flags():
    argv = sglang_server_argv("/models/m", "127.0.0.1", 30000, {"sglang_mem_fraction_static": 0.8,
                                                                 "sglang_enable_metrics": True})
    names = flag_names(argv)
    assert {"--model-path", "--host", "--port", "--mem-fraction-static", "--enable-metrics"} <= set(names)
    assert [n for n in names if n not in SGLANG_FLAGS] == []
    assert KEY_FLAGS["engine"][0] in SGLANG_FLAGS


def test_a_flag_sglang_lacks_is_seen():
    """The check can fail: a made-up flag is not in the list."""
    assert "--add-url" not in SGLANG_FLAGS and flag_names(["--add-url=x"]) == ["--add-url"]
