"""The local stack's supervisor and `up`'s adoption, on plain processes recorded as a stack's are: a process that dies
is started again as recorded and counted; `up` on a partly running stack starts only what is missing (same command
line and environment) and refuses clearly when the stack's tokens are gone; `down` stops the supervisor first."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from physarum import cli, stack, supervisor
from services.common.procs import ManagedProcess, start_time

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def fake_stack(work_dir: Path, names: tuple[str, ...] = ("worker-a", "worker-b")) -> dict:
    """stack.json recording a running process per name (each ready as soon as it runs), as `up` writes it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    secrets = work_dir / "secrets" / "worker"
    secrets.mkdir(parents=True)
    processes = [ManagedProcess(name, SLEEPER, work_dir / "logs" / f"{name}.log",
                                env={"PHYSARUM_TOKEN_DIR": str(secrets)}).start() for name in names]
    state = {"work_dir": str(work_dir), "processes": [stack._entry(p) for p in processes]}
    (work_dir / stack.STATE_FILE).write_text(json.dumps(state))
    return state


def kill(entry: dict) -> None:
    os.kill(entry["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while stack.owned(entry) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_dead_process_is_started_again_as_recorded_and_counted(tmp_path):
    state = fake_stack(tmp_path)
    try:
        kill(state["processes"][0])
        supervisor.supervise(tmp_path, poll_s=0.01, rounds=1)
        after = stack.read_state(tmp_path)
        first, second = after["processes"]
        assert stack.owned(first) and first["pid"] != state["processes"][0]["pid"]
        assert first["argv"] == SLEEPER and first["env"] == state["processes"][0]["env"]
        assert second == state["processes"][1]  # untouched
        assert supervisor.read(tmp_path)["restarts"] == {"worker-a": 1}
        kill(first)  # dies again: started again, counted again
        supervisor.supervise(tmp_path, poll_s=0.01, rounds=1)
        assert supervisor.read(tmp_path)["restarts"] == {"worker-a": 2}
        assert "worker-a" in cli.services_table(stack.read_state(tmp_path), tmp_path)
    finally:
        stack.down(tmp_path, grace_s=5)


def test_up_on_a_partly_running_stack_starts_only_what_is_missing(tmp_path):
    state = fake_stack(tmp_path)
    try:
        kill(state["processes"][1])
        adopted = stack.up(stack.StackOptions(work_dir=tmp_path))  # no model: a fresh start would refuse
        first, second = adopted["processes"]
        assert first == state["processes"][0]
        assert stack.owned(second) and second["pid"] != state["processes"][1]["pid"]
        assert (second["argv"], second["env"]) == (SLEEPER, state["processes"][1]["env"])
    finally:
        stack.down(tmp_path, grace_s=5)


def test_up_refuses_a_partly_running_stack_whose_tokens_are_gone(tmp_path):
    state = fake_stack(tmp_path)
    try:
        kill(state["processes"][1])
        (tmp_path / "secrets" / "worker").rmdir()
        with pytest.raises(stack.StackConflict, match="tokens .* are gone; run `physarum down` first"):
            stack.up(stack.StackOptions(work_dir=tmp_path))
        assert stack.owned(state["processes"][0])  # nothing of the running part was touched
    finally:
        stack.down(tmp_path, grace_s=5)


def test_down_stops_the_supervisor_before_the_stack(tmp_path):
    state = fake_stack(tmp_path)
    stack.start_supervisor(tmp_path)
    recorded = stack.read_state(tmp_path)["supervisor"]
    assert stack.owned(recorded)
    deadline = time.monotonic() + 60
    while supervisor.read(tmp_path).get("pid") != recorded["pid"] and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped = stack.down(tmp_path, grace_s=5)
    assert sorted(stopped) == ["worker-a", "worker-b"]
    assert not stack.owned(recorded) and not any(stack.owned(e) for e in state["processes"])
    assert start_time(recorded["pid"]) is None
