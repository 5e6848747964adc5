"""A multi-turn environment on slime's BaseInteractionEnv (examples/geo3k_vlm_multi_turn/base_env.py, whose
format_observation puts an observation's images before its text) whose every observation shows a figure: an image
that differs per turn. The episode runs to max_turns whatever the model says (a tiny untrained model calls no tool).
`rollout_interaction_env_path` names this module for slime's geo3k_vlm_multi_turn rollout.py."""

from __future__ import annotations

from typing import Any

from examples.geo3k_vlm_multi_turn.base_env import BaseInteractionEnv
from PIL import Image


class FigureEnv(BaseInteractionEnv):
    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self.turn = 0

    def reset(self):
        self.turn = 0
        return {}, {}

    def step(self, response_text: str):
        self.turn += 1
        figure = Image.new("RGB", (28 * self.turn, 56), ((90 * self.turn) % 256, 40, 200))
        observation = {"obs_str": f"figure {self.turn}", "multi_modal_data": {"image": [figure]}}
        return observation, self.turn >= self.max_turns, {}


def build_env(sample: Any = None, args: Any = None, **_: Any) -> FigureEnv:
    return FigureEnv(max_turns=args.max_turns)
