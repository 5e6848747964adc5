"""Service settings from flags, environment variables and defaults, in that order of precedence.

A config is a kw-only frozen dataclass; field `redis_url` of service `buffer` becomes the flag `--redis-url`
and the variable `PHYSARUM_BUFFER_REDIS_URL`. The field's `help` metadata is the flag's help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
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


_SECRET_NAME = re.compile(r"(token|password|secret|api_key|credentials?)$", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?<=//)[^/@\s]*@")


def redacted(value: Any, name: str = "") -> Any:
    """`value` fit for a log: fields named like a secret become "***", passwords in URLs "***@"."""
    if isinstance(value, dict):
        return {k: redacted(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v, name) for v in value)
    if _SECRET_NAME.search(name) and value not in ("", None):
        return "***"
    if isinstance(value, str):
        return _URL_USERINFO.sub("***@", value)
    return value


def as_dict(config: Any) -> dict[str, Any]:
    """The config as a dict for the start-up log line: secrets redacted."""
    return redacted(dataclasses.asdict(config))
