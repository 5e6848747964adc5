"""Range checks for numbers and names that arrive from the network, before they reach Redis, a model or a thread.

Each check raises InvalidArgument naming the field, the value and the allowed range; NaN and infinities never pass.
"""

from __future__ import annotations

import math
import re

from services.common.errors import InvalidArgument

INT64_MAX = 2**63 - 1
MAX_WAIT_S = 3600.0        # the longest any call may ask a server to wait (GetBatch, TakeBatch, leases)
JOB_ID_MAX_LEN = 63        # a DNS label: job ids name Kubernetes objects, Redis keys and directories
_JOB_ID = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DATASET_KEY_MAX_LEN = 200  # a buffer job: a job id, or "<job_id>.eval.<name>" for an eval dataset
_DATASET_KEY = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.eval\.[-A-Za-z0-9_.]+)?")


def finite(name: str, value: float, low: float, high: float) -> float:
    """`value` as a float in [low, high]; NaN, infinities and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidArgument(f"{name} must be a finite number in [{low}, {high}], got {value!r}")
    return float(value)


def integer(name: str, value: int, low: int, high: int) -> int:
    """`value` as an int in [low, high] (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}")
    return value


def int64_fields(model: object) -> None:
    """Every int in a pydantic model's fields (lists included) fits int64: a bigger one breaks proto and JSON."""
    for name, value in vars(model).items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and not -INT64_MAX - 1 <= item <= INT64_MAX:
                raise InvalidArgument(f"{name} must fit in 64 bits, got {item}")


def dataset_key(value: str) -> str:
    """A buffer job: a job id, or "<job id>.eval.<eval dataset name>" (letters, digits, '_', '-', '.'); never '/',
    braces, NUL or a leading dot, at most 200 characters."""
    if not isinstance(value, str) or len(value) > DATASET_KEY_MAX_LEN or not _DATASET_KEY.fullmatch(value):
        shown = value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value
        raise InvalidArgument(f"job_id {shown!r}: expected a DNS label (lowercase letters, digits and '-', "
                              f"alphanumeric at both ends, 1-{JOB_ID_MAX_LEN} characters), or <job_id>.eval.<name>")
    return value


def job_id(value: str) -> str:
    """A job id: lowercase letters, digits and '-', starting and ending alphanumeric, at most 63 characters."""
    if not isinstance(value, str) or len(value) > JOB_ID_MAX_LEN or not _JOB_ID.fullmatch(value):
        shown = value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value
        raise InvalidArgument(f"job_id {shown!r}: expected a DNS label (lowercase letters, digits and '-', "
                              f"alphanumeric at both ends, 1-{JOB_ID_MAX_LEN} characters)")
    return value
