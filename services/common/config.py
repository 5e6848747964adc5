"""Service settings from flags, environment variables and defaults, in that order of precedence.

A config is a kw-only frozen dataclass; field `redis_url` of service `buffer` becomes the flag `--redis-url`
and the variable `PHYSARUM_BUFFER_REDIS_URL`. The field's `help` metadata is the flag's help text. A
`PHYSARUM_BUFFER_*` variable that names no field is an error (a typo would otherwise be silently ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def field(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    """A config field with its documentation."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _converter(tp: Any):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _converter(inner[0])
    if origin is list:
        item = _converter(typing.get_args(tp)[0])
        return lambda text: [item(x) for x in text.split(",") if x.strip()]
    if tp is bool:
        return _parse_bool
    return tp


def env_name(service: str, field_name: str) -> str:
    return f"PHYSARUM_{service.upper()}_{field_name.upper()}"


def unknown_variables(service: str, field_names: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """One message per `PHYSARUM_<SERVICE>_*` variable of `environ` that names no field, with the closest field."""
    prefix = env_name(service, "")
    known = {env_name(service, name) for name in field_names}
    messages = []
    for variable in sorted(os.environ if environ is None else environ):
        if variable.startswith(prefix) and variable not in known:
            close = difflib.get_close_matches(variable, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            messages.append(f"unknown variable {variable}{hint}: services.{service} has no field "
                            f"{variable[len(prefix):].lower()!r}")
    return messages


def load_config(cls: type[T], service: str, argv: list[str] | None = None, description: str = "") -> T:
    """Build `cls` from `argv` (flags), then `PHYSARUM_<SERVICE>_<FIELD>` variables, then defaults."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}", description=description)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{f.metadata.get('help', '')} (env {env_name(service, f.name)}; default: {default!r})"
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None, help=help_text,
                            metavar=f.name.upper())
    parsed = parser.parse_args(argv)
    unknown = unknown_variables(service, [f.name for f in fields])
    if unknown:
        parser.error("; ".join(unknown))
    values: dict[str, Any] = {}
    for f in fields:
        raw = getattr(parsed, f.name)
        source = f"--{f.name.replace('_', '-')}"
        if raw is None:
            raw = os.environ.get(env_name(service, f.name))
            source = env_name(service, f.name)
        if raw is None:
            continue
        try:
            values[f.name] = _converter(hints[f.name])(raw)
        except ValueError as err:
            parser.error(f"{source}: {err}")
    try:
        return cls(**values)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def as_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
