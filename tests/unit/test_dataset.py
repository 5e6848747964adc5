"""Prompt datasets: JSONL and Parquet rows, slime's keys, row slicing, and the errors for bad rows and files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.buffer.dataset import MAX_ERRORS, parse_path, read_prompts
from services.common.errors import InvalidArgument


def write_jsonl(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_good_and_bad_jsonl_rows(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        json.dumps({"input": "1+1=", "label": "2", "metadata": {"source_name": "add"}}),  # line 1
        "{not json",                                                                    # line 2
        json.dumps({"question": "2+2="}),                                               # line 3
        "",                                                                             # line 4: blank, ignored
        json.dumps({"input": 7}),                                                       # line 5
        json.dumps(["input", "x"]),                                                     # line 6
        json.dumps({"input": "3+3=", "metadata": "oops"}),                              # line 7
        json.dumps({"input": "4+4=", "label": {"answer": 8}}),                          # line 8
    ])
    rows = read_prompts(path, label_key="label")
    assert [(p.index, p.prompt, p.label) for p in rows.prompts] == [(0, "1+1=", "2"), (1, "4+4=", {"answer": 8})]
    assert rows.prompts[0].metadata == {"source_name": "add"} and rows.prompts[0].messages == []
    assert rows.num_skipped == 5
    assert rows.errors[0].startswith(f"dataset {path} line 2: invalid JSON: Expecting property name")
    assert rows.errors[1:] == [
        f"dataset {path} line 3: missing key 'input'",
        f"dataset {path} line 5: 'input' must be a string or a list of chat messages, got int",
        f"dataset {path} line 6: expected a JSON object, got list",
        f"dataset {path} line 7: 'metadata' must be an object, got str",
    ]


def test_keys_labels_and_chat_messages(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        json.dumps({"q": "hello", "a": 46, "meta": {"k": 1.5}}),
        json.dumps({"q": messages}),
        json.dumps({"q": [{"role": "user"}, {"role": "assistant", "content": None}]}),  # content missing
        json.dumps({"q": [{"role": "user", "content": ["an", "image"]}]}),
    ])
    rows = read_prompts(path, input_key="q", label_key="a", metadata_key="meta", apply_chat_template=True)
    assert rows.prompts[0].messages == [{"role": "user", "content": "hello"}] and rows.prompts[0].prompt == ""
    assert rows.prompts[0].label == 46 and rows.prompts[0].metadata == {"k": 1.5}
    assert rows.prompts[1].messages == messages and rows.prompts[1].label == ""
    # a message without content (or with None) is an empty string; a non-string content is an error
    assert rows.prompts[2].messages == [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    assert rows.errors == [f"dataset {path} line 4: 'q' message 0 must be an object with a string 'role' and 'content'"]
    # without apply_chat_template a string stays a raw prompt
    plain = read_prompts(path, input_key="q")
    assert plain.prompts[0].prompt == "hello" and plain.prompts[0].messages == [] and plain.prompts[0].label == ""


def test_only_the_first_errors_are_kept(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"input": "ok"})] + ["[]"] * (MAX_ERRORS + 5))
    rows = read_prompts(path)
    assert rows.num_skipped == MAX_ERRORS + 5 and len(rows.errors) == MAX_ERRORS
    assert rows.errors[-1] == f"dataset {path} line {MAX_ERRORS + 1}: expected a JSON object, got list"


def test_parquet_rows_with_messages_and_metadata(tmp_path):
    path = tmp_path / "train.parquet"
    table = pa.table({
        "input": [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "3+4="}]],
        "label": ["3", "7"],
        "metadata": [{"source_name": "a"}, {"source_name": "b"}],
    })
    pq.write_table(table, path)
    rows = read_prompts(str(path), label_key="label")
    assert [(p.index, p.messages[0]["content"], p.label, p.metadata["source_name"]) for p in rows.prompts] == [
        (0, "1+2=", "3", "a"), (1, "3+4=", "7", "b")]
    assert rows.num_skipped == 0 and rows.errors == []

    no_input = tmp_path / "no_input.parquet"
    pq.write_table(pa.table({"question": ["x", "y"]}), no_input)
    with pytest.raises(InvalidArgument, match=r"no valid prompts \(2 rows skipped\).*row 1: missing key 'input'"):
        read_prompts(str(no_input))


def test_parse_path_slices():
    assert parse_path("data.jsonl") == (Path("data.jsonl"), slice(None))
    path, rows = parse_path("/d/data.jsonl@[10:-5]")
    assert str(path) == "/d/data.jsonl" and rows == slice(10, -5)
    assert parse_path("x.parquet@[:3]")[1] == slice(None, 3)
    assert parse_path("x.parquet@[-2:]")[1] == slice(-2, None)
    with pytest.raises(InvalidArgument, match=r"dataset x.jsonl@\[a:b\]: bad row slice"):
        parse_path("x.jsonl@[a:b]")


@pytest.mark.parametrize(("suffix", "expected"), [
    ("@[1:3]", ["p1", "p2"]), ("@[-2:]", ["p3", "p4"]), ("@[:-3]", ["p0", "p1"]), ("@[2:]", ["p2", "p3", "p4"]),
])
def test_sliced_reads(tmp_path, suffix, expected):
    path = write_jsonl(tmp_path / "five.jsonl", [json.dumps({"input": f"p{i}"}) for i in range(5)])
    rows = read_prompts(path + suffix)
    assert [p.prompt for p in rows.prompts] == expected
    assert [p.index for p in rows.prompts] == list(range(len(expected)))  # indices are dense within the slice


def test_slice_counts_bad_rows_but_not_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [json.dumps({"input": "a"}), "", "oops", json.dumps({"input": "b"})])
    rows = read_prompts(path + "@[1:3]")
    assert [p.prompt for p in rows.prompts] == ["b"] and rows.num_skipped == 1
    assert rows.errors[0].startswith(f"dataset {path} line 3: invalid JSON")


def test_bad_files(tmp_path):
    with pytest.raises(InvalidArgument, match=f"dataset {tmp_path}/missing.jsonl: no such file"):
        read_prompts(str(tmp_path / "missing.jsonl@[0:2]"))
    csv = tmp_path / "train.csv"
    csv.write_text("input\nx\n")
    with pytest.raises(InvalidArgument, match=r"train.csv: unsupported format '.csv' \(expected .jsonl or .parquet\)"):
        read_prompts(str(csv))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InvalidArgument, match="broken.parquet: cannot read parquet"):
        read_prompts(str(broken))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InvalidArgument, match="no valid prompts .0 rows skipped.: the selected rows are empty"):
        read_prompts(str(empty))


def test_non_finite_numbers_and_deep_nesting_are_skipped_at_load(tmp_path):
    deep = '{"input": "x", "metadata": {"a": ' + "[" * 40 + "]" * 40 + "}}"
    path = write_jsonl(tmp_path / "hostile.jsonl", [
        '{"input": "nan", "metadata": {"score": NaN}}',    # line 1
        '{"input": "inf", "label": Infinity}',             # line 2
        deep,                                               # line 3: within the parser's limit, past ours
        "[" * 100_000 + "]" * 100_000,                      # line 4: past the parser's recursion limit
        json.dumps({"input": "ok", "metadata": {"score": 0.5}}),
    ])
    rows = read_prompts(path)
    assert [p.prompt for p in rows.prompts] == ["ok"] and rows.num_skipped == 4
    assert rows.errors == [
        f"dataset {path} line 1: invalid JSON: NaN is not a JSON number",
        f"dataset {path} line 2: invalid JSON: Infinity is not a JSON number",
        f"dataset {path} line 3: nested more than 32 levels",
        f"dataset {path} line 4: invalid JSON: nested more than 32 levels",
    ]

    parquet = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"input": ["a", "b"], "metadata": [{"score": float("nan")}, {"score": 1.0}]}), parquet)
    rows = read_prompts(str(parquet))
    assert [p.prompt for p in rows.prompts] == ["b"]
    assert rows.errors == [f"dataset {parquet} row 1: holds nan, not a finite number"]


def test_paths_outside_the_data_roots_are_refused_after_normalisation(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    inside = write_jsonl(root / "train.jsonl", [json.dumps({"input": "1+1="})])
    (tmp_path / "secret.jsonl").write_text(json.dumps({"input": "secret"}) + "\n")
    (root / "link.jsonl").symlink_to(tmp_path / "secret.jsonl")
    assert [p.prompt for p in read_prompts(inside + "@[0:1]", roots=[str(root)]).prompts] == ["1+1="]
    for escape in (f"{root}/../secret.jsonl", str(root / "link.jsonl"), "/etc/passwd", f"{root}/a\x00b.jsonl"):
        with pytest.raises(InvalidArgument, match="dataset"):
            read_prompts(escape, roots=[str(root)])


def test_labels_keep_their_json_type_through_the_proto():
    from services.common.samples import (
        Prompt,
        Sample,
        prompt_from_proto,
        prompt_to_proto,
        sample_from_proto,
        sample_to_proto,
    )
    for label in ["7", {"ground_truth": ["a", "b"]}, [1, 2], 3, 2.5, None, True]:
        prompt = Prompt(job_id="j", index=0, epoch=0, label=label)
        assert prompt_from_proto(prompt_to_proto(prompt)).label == label
        back = sample_from_proto(sample_to_proto(Sample(label=label, rollout_id=4, train_metadata={"k": "v"})))
        assert (back.label, type(back.label), back.rollout_id, back.train_metadata) == \
            (label, type(label), 4, {"k": "v"})
    assert sample_from_proto(sample_to_proto(Sample())).rollout_id is None
