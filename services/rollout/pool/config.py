"""The engine pool's settings: one frozen dataclass, checked on construction (the manager builds it from its flags)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgument

JOIN_MODES = ("disk", "sync")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    replicas: int = 0  # engines to launch (external ones come on top)
    join_mode: str = "disk"  # how a new engine gets the current weights: "disk" (snapshot now) or "sync" (next sync)
    snapshot_dir: str = ""  # where the trainer writes weight snapshots for the disk join
    health_check_interval_s: float = 10.0
    health_check_timeout_s: float = 30.0
    health_check_first_wait_s: float = 0.0
    start_timeout_s: float = 120.0  # launch -> /health
    drain_timeout_s: float = 30.0
    disk_load_timeout_s: float = 120.0
    weight_sync_max_s: float = 600.0  # health checks stay off this long at most for a sync whose end never comes
    launcher_poll_s: float = 1.0
    tick_s: float = 0.2
    own_router: bool = False  # remove router workers this pool never registered (one manager per router)
    max_start_failures: int = 3  # engines failing before the pool first served: then start() fails
    # A launched engine that dies before it has shown that engines start (it served, or answered /health and stayed
    # healthy healthy_proof_s) counts as a start failure: it is replaced after a wait that doubles with each one in a
    # row (start_backoff_s, 2x, 4x ... at most start_backoff_max_s), so a crash loop (a bad model, too little memory)
    # is not relaunched flat out. Any other dead engine (killed, evicted, lost with its node) is replaced at once, and
    # an engine that shows it starts forgets the failures counted so far: repeated kills never grow the wait.
    healthy_proof_s: float = 5.0
    start_backoff_s: float = 1.0
    start_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise InvalidArgument(f"replicas must be >= 0, got {self.replicas}")
        if self.join_mode not in JOIN_MODES:
            raise InvalidArgument(f"join_mode must be one of {', '.join(JOIN_MODES)}, got {self.join_mode!r}")
