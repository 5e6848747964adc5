"""The engine pool: launch engines (launchers.py, k8s.py), admit each to the router once it holds the trainer's
current weights, check, drain and replace them (pool.py decides, engine_steps.py acts). It knows nothing of prompts."""
