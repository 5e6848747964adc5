"""Real SGLang servers for GPU nodes: `python -m sglang.launch_server` with every `sglang_*` option passed through as
a server argument, like slime's --sglang- prefix (`sglang_mem_fraction_static: 0.8` -> `--mem-fraction-static 0.8`).

Only builds the command line; LocalLauncher runs it, the Helm chart's engine Deployment runs the same one in a pod.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from services.common.errors import InvalidArgument

KEYED_LAUNCH = "services.rollout.pool.keyed_launch"
PREFIX = "sglang_"
OWNED = ("model_path", "host", "port", "admin_api_key")  # the launcher sets these itself


def sglang_server_args(options: Mapping[str, Any]) -> list[str]:
    """`--flag value` pairs for `sglang_*` options: true -> a bare flag, false/None -> left out, a list -> values."""
    argv: list[str] = []
    for key, value in options.items():
        if not key.startswith(PREFIX) or key == PREFIX:
            raise InvalidArgument(f"sglang option {key!r}: SGLang server options are named sglang_<server flag>, "
                                  f"e.g. sglang_mem_fraction_static")
        name = key.removeprefix(PREFIX)
        if name in OWNED:
            raise InvalidArgument(f"sglang option {key!r}: the engine launcher sets --{name.replace('_', '-')} itself")
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def sglang_server_argv(model_path: str, host: str, port: int, options: Mapping[str, Any],
                       python: str = sys.executable) -> list[str]:
    """The full command line of one SGLang server on host:port; started through keyed_launch, which adds
    `--admin-api-key` from the engine token file when there is one (weight updates only from the manager and the
    trainer)."""
    return [python, "-m", KEYED_LAUNCH, "engine", "sglang.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), *sglang_server_args(options)]


def parse_sglang_options(items: list[str]) -> dict[str, Any]:
    """`["sglang_tp_size=2", "sglang_enable_metrics=true"]` -> {"sglang_tp_size": 2, "sglang_enable_metrics": True}.

    Values are YAML scalars or lists, as in `physarum submit --set`; the keys are checked by sglang_server_args.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(f"sglang option {item!r}: expected sglang_<flag>=<value>")
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise InvalidArgument(f"sglang option {item!r}: value is not a YAML scalar or list: {err}") from None
    sglang_server_args(options)
    return options
