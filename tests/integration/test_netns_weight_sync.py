"""The weight broadcast across "hosts": trainer and two CPU engines, each in its own network namespace (pod).

Pods talk over a bridge by headless-Service names, gloo on eth0; cutting one engine's cable must fail the sync within
its timeout while the other engine keeps serving. Root only (CI runs it). The tests run in file order, sharing pods.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from services.common import procs
from testkit import netns
from tests.integration.hf_weights import hf_weights, perturbed
from tests.integration.netns_trainer import TrainerPod, digest

TIMEOUT_S = 5.0
SLACK_S = 2.0
ENGINE_PORT = 30000
TRAINER = "physarum-trainer-0"
ENGINES = ("physarum-engine-0", "physarum-engine-1")


def skip_without_netns() -> None:
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"multi-host weight sync needs network namespaces: {reason}")


@pytest.fixture(scope="module")
def network(session_dir):
    skip_without_netns()
    net = netns.Network(f"px{os.getpid()}", session_dir / "netns")
    try:
        net.create([(TRAINER, "physarum-trainer")] + [(name, "physarum-engine") for name in ENGINES])
        yield net
    finally:
        made = list(net.namespaces)
        errors = net.teardown()
        assert not errors, errors
        assert not set(made) & netns.existing_namespaces(), "namespaces left behind"


@pytest.fixture(scope="module")
def pods(network, tiny_model_dir, session_dir):
    """Both engines and the trainer pod, started together; yields (trainer, {engine pod: (process, url)})."""
    log_dir = session_dir / "netns"
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    started: list[netns.PodProcess] = []
    try:
        engines = {}
        for name in ENGINES:
            argv = [sys.executable, "-m", "services.engine", "--host", network.pods[name].address,
                    "--port", str(ENGINE_PORT), "--model-path", str(tiny_model_dir),
                    "--weight-sync-timeout-s", str(TIMEOUT_S)]
            proc = netns.PodProcess(name, network.exec_argv(name, argv), log_dir / f"{name}.log", env=env).start()
            started.append(proc)
            engines[name] = (proc, f"http://{network.pods[name].hostname}:{ENGINE_PORT}")
        argv = [sys.executable, "-m", "tests.integration.netns_trainer", "--model-path", str(tiny_model_dir),
                "--master-address", network.pods[TRAINER].hostname, "--timeout-s", str(TIMEOUT_S)]
        proc = netns.PodProcess(TRAINER, network.exec_argv(TRAINER, argv), log_dir / f"{TRAINER}.log", env=env,
                                interactive=True).start()
        started.append(proc)
        trainer = TrainerPod(proc)
        assert trainer.read(timeout_s=120) == {"ready": True}
        for proc, url in engines.values():  # probed from the trainer's pod: the root namespace has no way in
            proc.wait_ready(lambda u=url: trainer.request("http", method="GET", url=f"{u}/health").get("status")
                            == 200, timeout_s=120)
        yield trainer, engines
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> dict:
    return hf_weights(tiny_model_dir)


def assert_engine_has(trainer: TrainerPod, url: str, weights: dict, version: str) -> None:
    """The engine's tensors equal `weights` bit for bit, it reports `version` and it generates."""
    numels = {name: t.numel() for name, t in weights.items()}
    got = trainer.request("digests", url=url, numels=numels)["digests"]
    assert got == {name: digest(t) for name, t in weights.items()}, f"{url}: weights differ"
    reply = trainer.request("http", method="POST", url=f"{url}/generate",
                            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert reply.get("status") == 200, reply
    assert reply["json"]["meta_info"]["weight_version"] == version


def test_pods_have_no_route_out(network):
    for pod in network.pods.values():
        routes = netns.ip("-n", pod.netns, "route").stdout.split("\n")
        assert [r.split()[0] for r in routes if r.strip()] == [f"{netns.SUBNET}.0/24"], routes


def test_broadcast_reaches_both_engines_across_pods(pods, weights):
    trainer, engines = pods
    urls = [url for _, url in engines.values()]
    reply = trainer.request("broadcast", urls=urls, seed=1, version="v1")
    assert reply["ok"], reply
    assert reply["stats"]["num_tensors"] == len(weights) and reply["stats"]["num_engines"] == 2
    for url in urls:
        assert_engine_has(trainer, url, perturbed(weights, 1), "v1")


def test_cut_link_fails_within_timeout_and_the_other_engine_keeps_serving(network, pods, weights):
    trainer, engines = pods
    (_, live_url), (cut_proc, cut_url) = engines.values()
    network.set_link(ENGINES[1], up=False)
    start = time.monotonic()
    reply = trainer.request("broadcast", urls=[live_url, cut_url], seed=2, version="v2")
    elapsed = time.monotonic() - start
    assert not reply["ok"], reply
    assert reply["failed_urls"] == [cut_url]
    assert f"pause_generation, begin_weight_update failed on 1 of 2 engines: {cut_url}: " in reply["error"]
    assert reply["seconds"] <= elapsed < TIMEOUT_S + SLACK_S  # a timeout (the packets vanish), never a hang
    assert cut_proc.alive()  # the cable was cut, not the engine
    assert_engine_has(trainer, live_url, perturbed(weights, 1), "v1")  # unchanged, not left paused
    reply = trainer.request("broadcast", urls=[live_url], seed=2, version="v2")
    assert reply["ok"], reply
    assert_engine_has(trainer, live_url, perturbed(weights, 2), "v2")


def test_replugged_engine_rejoins_the_group(network, pods, weights):
    trainer, engines = pods
    urls = [url for _, url in engines.values()]
    network.set_link(ENGINES[1], up=True)
    reply = trainer.request("broadcast", urls=urls, seed=3, version="v3")
    assert reply["ok"], reply
    for url in urls:
        assert_engine_has(trainer, url, perturbed(weights, 3), "v3")


def test_teardown_removes_namespaces_and_processes(session_dir):
    skip_without_netns()
    net = netns.Network(f"px{os.getpid()}t", session_dir / "netns-teardown")
    try:
        net.create([("a-0", "a"), ("b-0", "b")])
        proc = netns.PodProcess("sleeper", net.exec_argv("a-0", ["sleep", "60"]), session_dir / "sleeper.log").start()
        made = set(net.namespaces)
        assert made <= netns.existing_namespaces() and len(made) == 3
        proc.wait_ready(lambda: procs.cmdline_of(proc.pid) == ["sleep", "60"], timeout_s=5)  # both wrappers exec'd
        assert proc.owns_pid()
        assert proc.stop() == -15
    finally:
        assert net.teardown() == []
    assert not made & netns.existing_namespaces()
