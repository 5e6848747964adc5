"""Fixtures of the chart tests: the value sets as a parameter, their rendered objects, a chart copy without schema."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.chart.chart import CHART, VALUE_SETS, rendered


@pytest.fixture(params=list(VALUE_SETS))
def value_set(request) -> str:
    return request.param



@pytest.fixture
def objects(value_set) -> tuple[dict, ...]:
    return rendered(value_set)


@pytest.fixture(scope="session")
def chart_without_schema(tmp_path_factory) -> Path:
    """A copy of the chart without values.schema.json: what `helm install --skip-schema-validation` renders, so the
    template guards can be tested on values the schema would refuse first."""
    copy = tmp_path_factory.mktemp("chart") / "physarum"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    return copy
