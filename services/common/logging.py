"""Stdlib logging set up once per process: one-line text locally, JSON lines in the cluster."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in ("job_id", "rollout_id", "engine", "weight_version"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger; PHYSARUM_LOG_FORMAT=json switches to JSON lines."""
    level = (level or os.environ.get("PHYSARUM_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("PHYSARUM_LOG_FORMAT", "text") == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
