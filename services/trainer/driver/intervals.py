"""slime's rule for periodic actions (save, eval, async weight pushes): every N rollouts, at each epoch's end, and
after the last rollout."""

from __future__ import annotations


def should_run_periodic_action(rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None,
                               num_rollout: int | None = None) -> bool:
    """slime's rule: every `interval` rollouts, at each epoch's end, and at the last rollout (interval None: never)."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)
