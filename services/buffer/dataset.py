"""Prompt rows from .jsonl or .parquet files, with slime's keys and `path@[start:end]` row slicing.

Malformed rows are skipped and reported by file and line. The buffer stores chat messages as given;
rendering chat templates is left to the rollout manager.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import strict_json
from services.common.errors import InvalidArgument
from services.common.paths import confine
from services.common.samples import Prompt, dict_to_struct

log = logging.getLogger(__name__)

MAX_ERRORS = 10
MAX_DEPTH = 32                 # nesting of lists and objects in a row (a chat message list is 3 deep)
MAX_ROW_BYTES = 16 << 20       # one row's JSON; a longer line is skipped unread
_SLICED = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


@dataclass
class PromptRows:
    """The valid rows of a dataset as prompts (index = position among them), and what was skipped."""

    prompts: list[Prompt]
    num_skipped: int
    errors: list[str]


def parse_path(spec: str) -> tuple[Path, slice]:
    """`data.jsonl@[10:-5]` -> (Path("data.jsonl"), slice(10, -5)); no suffix selects every row."""
    match = _SLICED.match(spec)
    if match is None:
        if "@[" in spec:
            raise InvalidArgument(f"dataset {spec}: bad row slice (expected PATH@[START:END], e.g. data.jsonl@[0:100])")
        return Path(spec), slice(None)
    start, end = (int(x) if x else None for x in (match["start"], match["end"]))
    return Path(match["path"]), slice(start, end)


def read_prompts(spec: str, *, input_key: str = "input", label_key: str = "", metadata_key: str = "metadata",
                 apply_chat_template: bool = False, roots: Sequence[str] = ()) -> PromptRows:
    """Read and validate the rows selected by `spec` (a path, optionally with `@[start:end]`), which must lie
    under one of `roots` (when any are given)."""
    path, rows = parse_path(spec)
    path = confine(str(path), roots, "dataset")
    if not path.is_file():
        raise InvalidArgument(f"dataset {path}: no such file")
    if path.suffix == ".jsonl":
        records = list(_jsonl_records(path))[rows]
    elif path.suffix == ".parquet":
        records = list(_parquet_records(path))[rows]
    else:
        raise InvalidArgument(f"dataset {path}: unsupported format {path.suffix!r} (expected .jsonl or .parquet)")
    prompts: list[Prompt] = []
    errors: list[str] = []
    num_skipped = 0
    for where, record in records:
        try:
            prompts.append(_to_prompt(record, len(prompts), input_key, label_key, metadata_key, apply_chat_template))
        except ValueError as err:
            num_skipped += 1
            if len(errors) < MAX_ERRORS:
                errors.append(f"dataset {path} {where}: {err}")
                log.warning("skipped %s", errors[-1])
    if num_skipped > len(errors):
        log.warning("dataset %s: %d more malformed rows skipped", path, num_skipped - len(errors))
    if not prompts:
        reasons = "; ".join(errors) or "the selected rows are empty"
        raise InvalidArgument(f"dataset {spec}: no valid prompts ({num_skipped} rows skipped): {reasons}")
    return PromptRows(prompts=prompts, num_skipped=num_skipped, errors=errors)


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed object or the ValueError that made it unreadable) per non-blank line."""
    with path.open("rb") as lines:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if len(line) > MAX_ROW_BYTES:
                yield f"line {line_no}", ValueError(f"row of {len(line)} bytes (at most {MAX_ROW_BYTES})")
                continue
            try:
                yield f"line {line_no}", json.loads(line, parse_constant=_refuse_constant)
            except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
                yield f"line {line_no}", ValueError(f"invalid JSON: {err}")
            except RecursionError:
                yield f"line {line_no}", ValueError(f"invalid JSON: nested more than {MAX_DEPTH} levels")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _check_value(value: Any, depth: int = 0) -> None:
    """Refuse nesting deeper than MAX_DEPTH, non-finite floats (a parquet row can hold NaN) and text that is not
    Unicode (a JSON escape of a lone surrogate, which no proto or Redis write could encode)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"holds {value!r}, not a finite number")
    if isinstance(value, str) and (problem := strict_json.check_value(value, "a string")):
        raise ValueError(problem)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_value(key, depth + 1)
            _check_value(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_value(item, depth + 1)


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        row_no = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                row_no += 1
                yield f"row {row_no}", record
    except (pa.ArrowException, OSError) as err:
        raise InvalidArgument(f"dataset {path}: cannot read parquet: {err}") from None


def _to_prompt(record: Any, index: int, input_key: str, label_key: str, metadata_key: str,
               apply_chat_template: bool) -> Prompt:
    if isinstance(record, ValueError):
        raise record
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    _check_value(record)
    if input_key not in record:
        raise ValueError(f"missing key {input_key!r}")
    value = record[input_key]
    prompt, messages = "", []
    if isinstance(value, str):
        if apply_chat_template:
            messages = [{"role": "user", "content": value}]
        else:
            prompt = value
    elif isinstance(value, list):
        messages = [_message(m, i, input_key) for i, m in enumerate(value)]
    else:
        raise ValueError(f"{input_key!r} must be a string or a list of chat messages, got {type(value).__name__}")
    label = record.get(label_key) if label_key else None  # keeps its JSON type, as slime's does
    metadata = record.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{metadata_key!r} must be an object, got {type(metadata).__name__}")
    try:
        dict_to_struct(metadata)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{metadata_key!r} holds a value JSON cannot represent: {err}") from None
    return Prompt(job_id="", index=index, epoch=0, prompt=prompt, messages=messages,
                  label="" if label is None else label, metadata=metadata)


def _message(message: Any, position: int, input_key: str) -> dict[str, str]:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
            or not isinstance(content, (str, type(None))):
        raise ValueError(f"{input_key!r} message {position} must be an object with a string 'role' and 'content'")
    return {"role": message["role"], "content": content or ""}
