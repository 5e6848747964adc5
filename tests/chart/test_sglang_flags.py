"""The flags Physarum passes to SGLang's `launch_server` are flags of the SGLang release the chart pins: the chart's
engine args (with the gpu-cluster value set's extraArgs), the local launcher's fixed ones and the admin-key flag.
The image the chart pins is named as SGLang's release workflows name theirs (tests/data/sglang_image_tags.json, read
from those workflows), for that same release, and pinned by digest.

tests/data/sglang_server_flags.json is read from the sglang wheel of that release by scripts/sglang_server_flags.py
(SGLang itself cannot be imported without CUDA kernels); a new pin in values.yaml needs the file written again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.rollout.pool.keyed_launch import FLAGS as KEY_FLAGS
from services.rollout.pool.sglang_launcher import sglang_server_argv
from tests.chart.chart import CHART, rendered

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_server_flags.json").read_text())
IMAGE_TAGS = json.loads((Path(__file__).resolve().parents[1] / "data" / "sglang_image_tags.json").read_text())
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


def release_of(tag: str) -> str | None:
    """The SGLang version a tag of SGLang's own release naming pins (None: not such a tag, or a moving one)."""
    for pattern in IMAGE_TAGS["tags"]:
        if "{version}" in pattern:
            regex = re.escape(pattern).replace(re.escape("{version}"), r"(\d+\.\d+\.\d+(?:\.post\d+)?)")
            if match := re.fullmatch(regex, tag):
                return match.group(1)
    return None


def test_the_sglang_image_is_a_release_tag_of_sglangs_own_naming_pinned_by_digest():
    image = yaml.safe_load((CHART / "values.yaml").read_text())["engines"]["sglang"]["image"]
    assert image["repository"] == IMAGE_TAGS["repository"]
    assert release_of(image["tag"]) == DATA["sglang_version"], image["tag"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", image["digest"])
    (engine,) = [o for o in rendered("gpu-cluster") if o["kind"] == "Deployment"
                 and o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    pulled = engine["spec"]["template"]["spec"]["containers"][0]["image"]
    assert pulled.endswith(f"@{image['digest']}") and pulled.startswith(IMAGE_TAGS["repository"]), pulled


def test_a_tag_sglang_never_pushes_is_seen():
    """The check can fail: no v prefix, a made-up CUDA suffix and a moving tag are not release tags."""
    assert release_of("v0.5.17-cu130-runtime") == "0.5.17" and release_of("v0.5.17") == "0.5.17"
    assert release_of("0.5.17") is None and release_of("v0.5.17-cu118-runtime") is None and release_of("latest") is None
