"""RL algorithms as pure functions on tensors: reward post-processing, advantage estimators and
whitening, discounted returns and GAE, KL estimators, losses.

Formulas and defaults follow slime (`slime/utils/ppo_utils.py`, `slime/backends/megatron_utils/loss.py`);
nothing here reads a config, touches a model or does I/O — the backends compose these functions.
"""
