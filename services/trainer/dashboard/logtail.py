"""The trainer's recent log lines, kept in memory so that the dashboard shows a job's log tail.

A line belongs to a job when its record carries the job's id (`extra={"job_id": ...}`) or its message names it;
the driver's messages name their job ("job demo-grpo rollout 3: ..."). Only rank 0's lines are here.
"""

from __future__ import annotations

import collections
import logging
import threading

MAX_LINES = 4000  # all jobs together
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogTail(logging.Handler):
    """A bounded ring of formatted records, searched per job."""

    def __init__(self, max_lines: int = MAX_LINES, level: int = logging.INFO) -> None:
        super().__init__(level)
        self._lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_lines)
        self._lock_lines = threading.Lock()
        self.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging.Handler's contract: never raise from emit
            self.handleError(record)
            return
        with self._lock_lines:
            self._lines.append((str(getattr(record, "job_id", "")), line))

    def tail(self, job_id: str, num_lines: int) -> list[str]:
        """The last `num_lines` lines of job `job_id`, oldest first."""
        with self._lock_lines:
            lines = list(self._lines)
        mine = [line for owner, line in lines if owner == job_id or (not owner and job_id in line)]
        return mine[-num_lines:] if num_lines > 0 else []


_installed: LogTail | None = None
_install_lock = threading.Lock()


def install() -> LogTail:
    """This process's LogTail on the root logger (once; later calls return the same one)."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = LogTail()
        root = logging.getLogger()
        if _installed not in root.handlers:  # configure_logging replaces the root's handlers
            root.addHandler(_installed)
        return _installed
