"""The training driver: each mode's loop, the rollouts, eval, metrics, and the conversion of slime's
checkpoints at job start."""
