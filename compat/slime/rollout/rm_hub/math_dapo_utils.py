"""slime.rollout.rm_hub.math_dapo_utils: DAPO's Minerva-style answer check."""

from __future__ import annotations

from typing import Any

from services.reward.rm.dapo import dapo_reward, normalize_final_answer


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    if pause_tokens_index is not None:
        raise NotImplementedError("math_dapo_utils.compute_score: pause_tokens_index is not provided by Physarum's "
                                  "slime compatibility layer")
    return dapo_reward(solution_str, ground_truth, strict_box=strict_box_verify)


__all__ = ["compute_score", "normalize_final_answer"]
