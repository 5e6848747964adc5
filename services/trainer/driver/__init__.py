"""The training driver: the loop, the rollout feeds of each mode, eval, metrics, and the conversion of slime's
checkpoints at job start."""
