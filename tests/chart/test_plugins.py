"""A user's plugin code reaches the pods that load plugins: with plugins.image set, the trainer, rollout manager and
reward pods copy the image's sourcePath into a volume (an init container), mount it read-only at mountPath, and put
it on PYTHONPATH; the allow-list goes with it; no other pod gets it, and without an image nothing changes."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart.chart import VALUE_SETS, find, render, render_raw, rendered

LOADERS = ("trainer", "rollout", "reward")


def pod_spec(objects, component: str) -> dict:
    (workload,) = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")
                   and o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return workload["spec"]["template"]["spec"]


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("component", LOADERS)
def test_plugin_image_is_copied_mounted_and_on_the_path(component):
    values = VALUE_SETS["plugins"]
    spec = pod_spec(rendered("plugins"), component)
    (init,) = [c for c in spec["initContainers"] if c["name"] == "plugins"]
    image = values["plugins"]["image"]
    assert init["image"] == f"{image['repository']}:{image['tag']}@{image['digest']}"
    assert init["command"] == ["cp", "-R", "/plugins/.", "/plugins-volume/"]
    assert {"name": "plugins", "mountPath": "/plugins-volume"} in init["volumeMounts"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True  # the pod runs it as uid 10001
    main = spec["containers"][0]
    assert {"name": "plugins", "mountPath": "/opt/physarum/plugins", "readOnly": True} in main["volumeMounts"]
    assert env(main)["PYTHONPATH"] == "/opt/physarum/plugins"
    assert env(main)["PHYSARUM_PLUGIN_ALLOWLIST"] == "examples"
    (volume,) = [v for v in spec["volumes"] if v["name"] == "plugins"]
    assert "emptyDir" in volume


def test_the_copy_runs_before_the_data_wait():
    """Plugins first: the pod can start loading nothing until both init containers are done, in order."""
    spec = pod_spec(render({**VALUE_SETS["plugins"], "models": {"persistence": {"enabled": True}},
                            "model": {"source": "hf", "hf": {"repo": "Qwen/Qwen3-0.6B"}}}), "trainer")
    names = [c["name"] for c in spec["initContainers"]]
    assert names[0] == "plugins" and "wait-for-data" in names


def test_pods_that_load_no_plugins_get_none():
    objects = rendered("plugins")
    for component in ("buffer", "router", "engine"):
        spec = pod_spec(objects, component)
        assert all(c["name"] != "plugins" for c in spec.get("initContainers", []))
        assert all(v["name"] != "plugins" for v in spec.get("volumes", []))


@pytest.mark.parametrize("component", LOADERS)
def test_no_plugin_image_changes_nothing(component):
    spec = pod_spec(rendered("default"), component)
    assert all(c["name"] != "plugins" for c in spec.get("initContainers", []))
    assert "PYTHONPATH" not in env(spec["containers"][0])


def test_a_bad_digest_is_refused_by_the_schema():
    with pytest.raises(helm.HelmValuesError, match="digest"):
        render_raw({"plugins": {"image": {"repository": "r/p", "digest": "latest"}}})


def test_plugins_value_set_renders_the_loaders():
    assert {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in find(rendered("plugins"), "Deployment")
            } >= {"rollout", "reward"}
