"""Service settings from flags, environment variables and defaults, in that order of precedence.

A config is a kw-only frozen dataclass; field `redis_url` of service `buffer` becomes the flag `--redis-url`
and the variable `PHYSARUM_BUFFER_REDIS_URL`. The field's `help` metadata is the flag's help text; its `check` (a
`Rule`) is its validation, run by `check_fields`, so a field declared once carries its rule wherever `shared` reuses
it. A `PHYSARUM_BUFFER_*` variable that names no field is an error (a typo would otherwise be silently ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
REQUIRED: Any = dataclasses.MISSING  # field(REQUIRED, ...): a setting without a default


@dataclass(frozen=True)
class Rule:
    """A field's validation: `ok(value)` must hold; `text` completes "<name> must be ...". None always passes."""

    ok: Callable[[Any], bool]
    text: str


POSITIVE = Rule(lambda v: v > 0, "> 0")
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
AT_LEAST_ONE = Rule(lambda v: v >= 1, ">= 1")
PROBABILITY = Rule(lambda v: 0 < v <= 1, "in (0, 1]")


def field(default: Any, help: str, check: Rule | None = None, internal: bool = False) -> Any:  # noqa: A002
    """A config field with its documentation and validation. `internal`: set by code, not a user's setting."""
    metadata = {"help": help, "check": check, "internal": internal}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def shared(owner: type, name: str) -> Any:
    """Field `name` of config class `owner`, reused by another config: the same default, help and rule."""
    declared = next((f for f in dataclasses.fields(owner) if f.name == name), None)
    if declared is None:
        raise AttributeError(f"{owner.__name__} declares no field {name!r} to share")
    metadata = {**declared.metadata, "declared_in": declared.metadata.get("declared_in", owner)}
    if declared.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=declared.default_factory, metadata=metadata)
    return dataclasses.field(default=declared.default, metadata=metadata)


def declared_in(cls: type, f: dataclasses.Field) -> type:
    """The config class that declares field `f` of `cls` (another one's, for a `shared` field)."""
    return f.metadata.get("declared_in", cls)


def settings(cls: type) -> list[dataclasses.Field]:
    """The user-facing fields of a config class (not the internal ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def own_settings(cls: type) -> list[dataclasses.Field]:
    """The settings `cls` declares itself (not those it shares from another config)."""
    return [f for f in settings(cls) if declared_in(cls, f) is cls]


def check_fields(config: Any, error: type[ValueError] = ValueError, where: str = "") -> None:
    """Raise `error` naming the first field whose value breaks its `Rule` or is not one of its `Literal` values."""
    hints = typing.get_type_hints(type(config))
    prefix = f"{where}: " if where else ""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        valid = literal_values(hints[f.name])
        optional = value is None and type(None) in typing.get_args(hints[f.name])
        if valid and value not in valid and not optional:
            raise error(f"{prefix}{f.name} must be one of {', '.join(map(str, valid))}, got {value!r}")
        rule = f.metadata.get("check")
        if rule is not None and value is not None and not rule.ok(value):
            raise error(f"{prefix}{f.name} must be {rule.text}, got {value}")


def literal_values(tp: Any) -> tuple:
    """The values of a `Literal[...]` type (or of an optional one); () for any other type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((v for a in typing.get_args(tp) if (v := literal_values(a))), ())
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


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
        # a boolean flag alone means true (SGLang's --enable-lora), or takes a value (--enable-lora false)
        flag = {"nargs": "?", "const": "true"} if hints[f.name] is bool else {}
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None, help=help_text,
                            metavar=f.name.upper(), **flag)
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
