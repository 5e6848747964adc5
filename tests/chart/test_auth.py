"""The chart turns per-service tokens on by default: a Secret of tokens, each pod mounting only those it needs."""

from __future__ import annotations

import base64

from physarum.stack import GRANTS
from tests.chart.chart import component as component_of
from tests.chart.chart import containers, env_of, find, one, pod_spec, render, workloads

# the token keys each component's pods may read: the local stack's grants (the trainer's own token is jobApi's)
EXPECTED = {"buffer": {"buffer"}, "reward": {"reward"}, "rollout": set(GRANTS["rollout"]),
            "trainer": set(GRANTS["trainer"]) - {"trainer"}, "engine": {"engine"}, "router": {"router"}}


def token_keys(workload: dict) -> set[str] | None:
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    if "service-tokens" not in volumes:
        return None
    items = volumes["service-tokens"]["secret"]["items"]
    assert all(item["path"] == f"{item['key']}.token" for item in items)
    return {item["key"] for item in items}


def test_each_component_mounts_only_the_tokens_it_needs(objects):
    secret = one(objects, "Secret", "auth")
    assert sorted(secret["data"]) == ["buffer", "engine", "reward", "rollout", "router"]
    assert all(len(base64.b64decode(v)) >= 32 for v in secret["data"].values())
    for workload in workloads(objects):
        name = component_of(workload)
        if name not in EXPECTED:
            assert token_keys(workload) is None, name  # redis holds no token
            continue
        assert token_keys(workload) == EXPECTED[name], name
        main = containers(workload)[-1]
        mounts = {m["name"]: m for m in main.get("volumeMounts", [])}
        assert mounts["service-tokens"]["readOnly"] is True
        env = env_of(main)
        if any(n.startswith("PHYSARUM_") for n in env):  # SGLang engines read no Physarum settings
            assert env["PHYSARUM_TOKEN_DIR"]["value"] == mounts["service-tokens"]["mountPath"], name
            assert env["PHYSARUM_PLUGIN_ALLOWLIST"]["value"] == "examples", name


def test_auth_off_mounts_nothing_and_the_allow_list_is_the_operators():
    objects = render({"auth": {"enabled": False}, "plugins": {"allowlist": ["examples", "acme.rl"]}})
    assert not find(objects, "Secret", "auth")
    for workload in workloads(objects):
        assert token_keys(workload) is None
        for c in containers(workload):
            env = env_of(c)
            assert "PHYSARUM_TOKEN_DIR" not in env
            if "PHYSARUM_PLUGIN_ALLOWLIST" in env:
                assert env["PHYSARUM_PLUGIN_ALLOWLIST"]["value"] == "examples,acme.rl"


def test_the_manager_owns_the_routers_worker_list(objects):
    [manager] = [w for w in workloads(objects) if component_of(w) == "rollout"]
    assert env_of(containers(manager)[-1])["PHYSARUM_ROLLOUT_OWN_ROUTER"]["value"] == "true"


def test_router_and_sglang_take_their_key_from_the_mounted_file_not_the_pod_spec(objects):
    """sglang-router and SGLang read their credential only as a flag: a shell reads the token file and execs them,
    so the token is in no manifest and no environment variable. Auth off: their own command."""
    expected = {"router": ("python -m sglang_router.launch_router", '--control-plane-api-keys '
                           '"rollout-manager:rollout-manager:admin:$(cat /var/run/physarum/tokens/router.token)"'),
                "engine": ("python3 -m sglang.launch_server",
                           '--admin-api-key "$(cat /var/run/physarum/tokens/engine.token)"')}
    for auth_on, objs in ((True, objects), (False, render({"auth": {"enabled": False}}))):
        for workload in workloads(objs):
            name = component_of(workload)
            if name not in expected:
                continue
            command = containers(workload)[-1]["command"]
            if command == ["python", "-m", "services.engine"]:
                continue  # the CPU engine reads its token file itself
            server, flag = expected[name]
            if auth_on:
                assert command == ["sh", "-c", f'exec {server} "$@" {flag}', name]
            else:
                assert command == server.split()
