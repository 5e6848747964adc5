"""One training step's parts every backend shares: the RL loss from a forward's tensors (rl_step.py), the optimizer
and its learning-rate schedule (optim.py), and the user's functions with slime's signatures (hooks.py)."""
