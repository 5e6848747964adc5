"""Prompt rows from .jsonl or .parquet files, with slime's keys and `path@[start:end]` row slicing.

Malformed rows are skipped and reported by file and line. The buffer stores chat messages as given;
rendering chat templates is left to the rollout manager. With slime's multimodal keys, each `<image>` in a prompt's
text becomes an image part and the row's images are read and checked here (images.py), once per prompt.
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

from services.buffer.images import MAX_IMAGES_PER_ROW, read_image
from services.common import strict_json
from services.common.errors import InvalidArgument
from services.common.paths import confine
from services.common.samples import MULTIMODAL_PLACEHOLDERS, Image, Prompt, dict_to_struct

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
                 apply_chat_template: bool = False, roots: Sequence[str] = (),
                 multimodal_keys: dict[str, str] | None = None) -> PromptRows:
    """Read and validate the rows selected by `spec` (a path, optionally with `@[start:end]`), which must lie
    under one of `roots` (when any are given). `multimodal_keys` maps a modality to the column of its items."""
    path, rows = parse_path(spec)
    path = confine(str(path), roots, "dataset")
    check_multimodal_keys(multimodal_keys or {})
    images = _ImageReader(multimodal_keys or {}, base_dir=path.parent, roots=roots)
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
            prompts.append(_to_prompt(record, len(prompts), input_key, label_key, metadata_key, apply_chat_template,
                                      images))
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


def check_multimodal_keys(multimodal_keys: dict[str, str]) -> None:
    """InvalidArgument unless every modality is one Physarum reads and every column a name."""
    for modality, column in multimodal_keys.items():
        if modality not in MULTIMODAL_PLACEHOLDERS:
            raise InvalidArgument(f"multimodal_keys: modality {modality!r} is not supported (supported: "
                                  f"{', '.join(MULTIMODAL_PLACEHOLDERS)})")
        if not isinstance(column, str) or not column:
            raise InvalidArgument(f"multimodal_keys: {modality!r} must name a column, got {column!r}")


@dataclass
class _ImageReader:
    """Turns a row's messages into messages with image parts and the images they stand for (slime's
    `_build_messages`): the k-th `<image>` of the text is the k-th item of the row's image column."""

    multimodal_keys: dict[str, str]
    base_dir: Path
    roots: Sequence[str]

    def build(self, record: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                                                         list[Image]]:
        column = self.multimodal_keys.get("image")
        items = record.get(column) if column else None
        if items is None:
            return messages, self._inline(messages)
        if not isinstance(items, list):
            items = [items]  # a row of one image may give it alone
        if len(items) > MAX_IMAGES_PER_ROW:
            raise ValueError(f"{column!r} holds {len(items)} images (at most {MAX_IMAGES_PER_ROW})")
        images: list[Image] = []
        built = []
        for message in messages:
            if not isinstance(message["content"], str):
                raise ValueError(f"{column!r}: a message whose content is already a list of parts cannot take "
                                 "images from a column")
            parts: list[dict[str, str]] = []
            for i, piece in enumerate(message["content"].split(MULTIMODAL_PLACEHOLDERS["image"])):
                parts += ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
            for part in parts:
                if part["type"] == "image":
                    if len(images) == len(items):
                        raise ValueError(f"more '<image>' placeholders in the prompt than the {len(items)} images in "
                                         f"{column!r}")
                    images.append(self._read(items[len(images)], f"{column!r} image {len(images)}"))
            built.append({"role": message["role"], "content": parts if any(p["type"] == "image" for p in parts)
                          else message["content"]})
        if len(images) < len(items):
            raise ValueError(f"{column!r} holds {len(items)} images but the prompt has {len(images)} '<image>' "
                             "placeholders")
        return built, images

    def _inline(self, messages: list[dict[str, Any]]) -> list[Image]:
        """The images given inside the messages' parts ({"type": "image", "image": ...}), read in place."""
        images: list[Image] = []
        for message in messages:
            if isinstance(message["content"], str):
                continue
            for part in message["content"]:
                if part["type"] == "image":
                    if len(images) == MAX_IMAGES_PER_ROW:
                        raise ValueError(f"more than {MAX_IMAGES_PER_ROW} images in the prompt")
                    images.append(self._read(part.pop("image"), f"image part {len(images)}"))
        return images

    def _read(self, item: Any, what: str) -> Image:
        try:
            return read_image(item, base_dir=self.base_dir, roots=self.roots)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None


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
               apply_chat_template: bool, image_reader: _ImageReader) -> Prompt:
    if isinstance(record, ValueError):
        raise record
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    _check_value(record)
    if input_key not in record:
        raise ValueError(f"missing key {input_key!r}")
    value = record[input_key]
    prompt, messages = "", []
    multimodal = bool(image_reader.multimodal_keys)
    if isinstance(value, str):
        if apply_chat_template or multimodal:  # slime: multimodal inputs need the conversation form
            messages = [{"role": "user", "content": value}]
        else:
            prompt = value
    elif isinstance(value, list):
        messages = [_message(m, i, input_key, multimodal) for i, m in enumerate(value)]
    else:
        raise ValueError(f"{input_key!r} must be a string or a list of chat messages, got {type(value).__name__}")
    images: list[Image] = []
    if multimodal:
        messages, images = image_reader.build(record, messages)
    label = record.get(label_key) if label_key else None  # keeps its JSON type, as slime's does
    metadata = record.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{metadata_key!r} must be an object, got {type(metadata).__name__}")
    try:
        dict_to_struct(metadata)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{metadata_key!r} holds a value JSON cannot represent: {err}") from None
    return Prompt(job_id="", index=index, epoch=0, prompt=prompt, messages=messages,
                  label="" if label is None else label, metadata=metadata, images=images)


def _message(message: Any, position: int, input_key: str, multimodal: bool) -> dict[str, Any]:
    content = message.get("content") if isinstance(message, dict) else None
    if multimodal and isinstance(message, dict) and isinstance(message.get("role"), str) \
            and isinstance(content, list):
        return {"role": message["role"], "content": [_part(p, position, input_key) for p in content]}
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
            or not isinstance(content, (str, type(None))):
        raise ValueError(f"{input_key!r} message {position} must be an object with a string 'role' and 'content'")
    return {"role": message["role"], "content": content or ""}


def _part(part: Any, position: int, input_key: str) -> dict[str, Any]:
    """A content part given in the data: {"type": "text", "text": ...} or {"type": "image", "image": ...}."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image" and part.get("image") is not None:
        return {"type": "image", "image": part["image"]}
    raise ValueError(f"{input_key!r} message {position}: a content part must be {{'type': 'text', 'text': ...}} or "
                     "{'type': 'image', 'image': ...}")
