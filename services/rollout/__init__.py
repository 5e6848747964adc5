"""The rollout service: generation/ (lease prompts, generate, score, write groups) and pool/ (the engines behind the
router). Other services use client.py; the local stack and tests use local.py to start a router on one machine."""
