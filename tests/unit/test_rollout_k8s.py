"""The pure parts of the Kubernetes engine launcher: which pod is a ready engine, and the retry backoff."""

from __future__ import annotations

import pytest

from services.rollout.pool.k8s import backoff_s, pod_engine_url

READY = {"phase": "Running", "podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}


def pod(status: dict, **metadata) -> dict:
    return {"metadata": {"name": "engine-0", **metadata}, "status": status}


def test_a_running_ready_pod_is_an_engine_at_its_ip_and_the_engine_port():
    assert pod_engine_url(pod(READY), 30000) == "http://10.1.2.3:30000"
    assert pod_engine_url(pod({**READY, "podIP": "fd00::1"}), 8000) == "http://[fd00::1]:8000"


@pytest.mark.parametrize("status, metadata", [
    ({**READY, "phase": "Pending"}, {}),
    ({**READY, "conditions": [{"type": "Ready", "status": "False"}]}, {}),
    ({**READY, "conditions": [{"type": "ContainersReady", "status": "True"}]}, {}),
    ({**READY, "conditions": None}, {}),
    ({**READY, "podIP": ""}, {}),
    (READY, {"deletionTimestamp": "2026-11-22T10:00:00Z"}),  # terminating: take it out of rotation now
    ({}, {}),
])
def test_any_other_pod_is_not_an_engine(status, metadata):
    assert pod_engine_url(pod(status, **metadata), 30000) is None


def test_backoff_doubles_from_the_base_is_capped_and_jittered_into_the_upper_half():
    assert [backoff_s(a, 0.5, 8.0, rand=lambda: 1.0) for a in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert [backoff_s(a, 0.5, 8.0, rand=lambda: 0.0) for a in range(1, 7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff_s(3, 0.5, 8.0, rand=lambda: 0.5) == 1.5
