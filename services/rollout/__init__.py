"""The rollout service: the engine pool and the generation loop (lease prompts, generate, score, write groups)."""
