"""A rollout generates nothing until the engines hold the trainer's weights: the trainer pushes its weights before
its first rollout, so the pool holds the version a rollout starts with; a manager restarted mid-job holds none (its
engines serve the checkpoint they started from) until the trainer announces its snapshot, right after the start.
Version 0, or a name that is no version number, is the engines' starting checkpoint."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.common.errors import FailedPrecondition

WAIT_S = 300.0  # how long a rollout waits for its engines to reach the trainer's weights before it fails
POLL_S = 0.2


def holds_version(now: str | None, want: str) -> bool:
    """The pool's settled version `now` is the trainer's `want` or newer (one_step_async and fully_async push on)."""
    return now is not None and (now == want or (now.isdigit() and want.isdigit() and int(now) >= int(want)))


async def wait_for(name: str, want: str, version_now: Callable[[], str | None] | None) -> None:
    """Return once the pool's version (`version_now()`; None: not tracked) holds `want`; FailedPrecondition naming
    rollout `name` after WAIT_S."""
    if version_now is None or not (want.isdigit() and int(want) > 0):
        return
    deadline = time.monotonic() + WAIT_S
    while not holds_version(version_now(), want):
        if time.monotonic() > deadline:
            raise FailedPrecondition(
                f"{name}: the engines hold weight version {version_now()!r}, not the trainer's {want}, "
                f"{WAIT_S:.0f} s after the start, and the trainer announced no snapshot of it (with "
                "engine_join_mode sync there is none to load): resume the job from its last checkpoint")
        await asyncio.sleep(POLL_S)
