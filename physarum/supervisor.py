"""The local stack's supervisor, as Kubernetes keeps a cluster's pods: `physarum up` starts it beside the stack; it
starts again, on the same ports and with the same tokens and Redis, every recorded process of the stack that died,
with a backoff per process, counts each restart in the work dir's supervisor.json (`physarum status` shows them) and
removes the shared-memory weight copies a dead trainer left behind. It ends when `physarum down` stops it.

`python -m physarum.supervisor --work-dir DIR`
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from physarum import stack
from services.common import weight_copies

log = logging.getLogger("physarum.supervisor")

STATE = "supervisor.json"
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # after the n-th restart in a row that did not last STABLE_S
STABLE_S = 60.0
POLL_S = 1.0


def read(work_dir: Path) -> dict:
    path = Path(work_dir) / STATE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"restarts": {}, "errors": {}}


def _write(work_dir: Path, record: dict) -> None:
    tmp = Path(work_dir) / f".{STATE}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(Path(work_dir) / STATE)


def dead_services(state: dict) -> list[str]:
    """The recorded processes that no longer run, the trainer's ranks as one ("trainer")."""
    names = []
    for entry in state["processes"]:
        name = "trainer" if stack.is_trainer(entry) else entry["name"]
        if name not in names and not stack.owned(entry):
            names.append(name)
    return names


def supervise(work_dir: Path, poll_s: float = POLL_S, rounds: int | None = None) -> None:
    """Restart what died until the stack is gone (its state file removed by `down`) or `rounds` checks are done."""
    work_dir = Path(work_dir).resolve()
    record = read(work_dir)
    record["pid"] = os.getpid()
    _write(work_dir, record)
    streak: dict[str, int] = {}  # restarts in a row that did not last STABLE_S
    next_try: dict[str, float] = {}
    started_at: dict[str, float] = {}
    done = 0
    while rounds is None or done < rounds:
        done += 1
        with stack.locked(work_dir):
            state = stack.read_state(work_dir)
            if state is None:
                return
            for name in dead_services(state):
                now = time.monotonic()
                if now < next_try.get(name, 0.0):
                    continue
                if now - started_at.get(name, -STABLE_S) >= STABLE_S:
                    streak[name] = 0
                record = read(work_dir)
                try:
                    log.warning("%s is not running: starting it again", name)
                    stack.restart(work_dir, name, lock_held=True)
                    if name == "trainer":
                        weight_copies.remove_stale()  # the dead trainer's copy of the weights in /dev/shm
                    record["errors"].pop(name, None)
                except Exception as err:  # noqa: BLE001 - reported in `physarum status`; tried again after a backoff
                    log.error("restarting %s failed: %s", name, err)
                    record["errors"][name] = f"{type(err).__name__}: {err}"[:500]
                record["restarts"][name] = record["restarts"].get(name, 0) + 1
                _write(work_dir, record)
                started_at[name] = time.monotonic()
                next_try[name] = started_at[name] + BACKOFF_S[min(streak.get(name, 0), len(BACKOFF_S) - 1)]
                streak[name] = streak.get(name, 0) + 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m physarum.supervisor", description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    supervise(args.work_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
