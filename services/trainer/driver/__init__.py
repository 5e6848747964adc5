"""The training driver: the loop, the rollout feeds of each mode, checkpoints, eval and metrics."""
