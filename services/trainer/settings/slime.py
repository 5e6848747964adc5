"""The job settings that carry slime's arguments: what plugins see in `args` beyond the spec's own keys, and what
converting a `slime_args` argv noted (services/trainer/slime_flags/args.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.config import field


@dataclass(frozen=True, kw_only=True)
class SlimeConfig:
    plugin_args: dict[str, Any] = field({}, "extra `args` for plugins: slime flags with no spec key of their own, "
                                            "custom_config_path's settings; the spec's keys win over them")
    slime_notes: list[str] = field([], "what converting slime_args mapped onto the deployment (set by the "
                                       "conversion)")
    slime_sources: dict[str, str] = field({}, "where each value converted from slime_args came from: the flag and "
                                              "its argv position (a repeated flag's last wins), or the spec's own key "
                                              "(set by the conversion)")
