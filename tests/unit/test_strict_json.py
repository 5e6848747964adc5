"""Plain JSON only: what Python's json and YAML accept but no reply, proto or Redis write can hold is named, with its
place, in one line; `physarum submit` prints that line for a bad job file instead of a traceback."""

import datetime
import math

import pytest

from services.common.errors import InvalidArgument
from services.common.strict_json import MAX_DEPTH, check_value, parse_body


@pytest.mark.parametrize(("value", "problem"), [
    ({"a": [1, {"b": math.nan}]}, "body.a[1].b: nan is not a finite number"),
    ({"a": -math.inf}, "body.a: -inf is not a finite number"),
    ({"a": "ok \ud800"}, "body.a: lone surrogate U+D800 at character 3"),
    ({"\udfff": 1}, "body key: lone surrogate U+DFFF at character 0"),
    ({"d": datetime.date(2024, 1, 1)}, "body.d: datetime.date(2024, 1, 1) is a date, not a JSON value"),
    ({1: "x"}, "body: key 1 is a int, not a string"),
])
def test_values_json_cannot_hold_are_named_with_their_place(value, problem):
    assert check_value(value).startswith(problem)


def test_plain_json_and_nesting_up_to_the_limit_pass():
    deep: object = 1
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    assert check_value({"a": "\u00e9\U0001f600", "n": None, "b": True, "i": 10**30, "f": 1.5, "l": deep}) == ""
    assert check_value({"l": [deep]}).endswith(f"nested more than {MAX_DEPTH} levels")
    assert check_value({"x": 1}, "") == "" and check_value({"x": math.nan}, "").startswith("x: nan")


@pytest.mark.parametrize(("body", "message"), [
    (b"NaN", "request body: invalid JSON: NaN is not a JSON number"),
    (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": 1e999999}', "1e999999 is out of a float's range"),
    (b'{"a": "\\ud800"}', "request body.a: lone surrogate U+D800"),
    (b'{"a": "\xff"}', "request body: not UTF-8 (byte 7: invalid start byte)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested more than"),
    (b'{"a": ' + b"9" * 5000 + b"}", "request body: invalid JSON: Exceeds the limit"),
])
def test_bodies_are_refused_with_one_clear_line(body, message):
    with pytest.raises(InvalidArgument, match=None) as err:
        parse_body(body)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_good_body_parses():
    assert parse_body(b'{"a": [1, 2.5, "\\ud83d\\ude00"]}') == {"a": [1, 2.5, "\U0001f600"]}


@pytest.mark.parametrize(("content", "says"), [
    (b"num_rollout: .nan\n", "physarum: job spec: num_rollout: nan is not a finite number"),
    (b"start: 2024-01-01\n", "physarum: job spec: start: datetime.date(2024, 1, 1) is a date, not a JSON value"),
    (b"a: \xff\xfe\x00\n", "not UTF-8 text (byte 3: invalid start byte)"),
    (b"a: 1\x00\n", "invalid YAML: unacceptable character #x0000"),
    (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than 64 levels"),
    (b"a: [1\n", "invalid YAML at line 2, column 1: expected ',' or ']'"),
    (b'a: "\\ud800"\n', "physarum: job spec: a: lone surrogate U+D800"),
])
def test_physarum_submit_prints_one_line_for_a_bad_job_file(tmp_path, content, says):
    from physarum.cli import load_job_file

    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as err:
        load_job_file(path, [])
    assert says in str(err.value.code) and "\n" not in str(err.value.code)


def test_physarum_submit_refuses_a_bad_set_value_in_one_line():
    from physarum.cli import load_job_file

    with pytest.raises(SystemExit, match=r"physarum: job spec: lr: nan is not a finite number"):
        load_job_file(None, ["lr=.nan"])
    with pytest.raises(SystemExit, match=r"physarum: --set a: invalid YAML at line 1"):
        load_job_file(None, ["a=[1"])
    assert load_job_file(None, ["lr=0.0001", "job_id=x"]) == {"lr": 1e-4, "job_id": "x"}
