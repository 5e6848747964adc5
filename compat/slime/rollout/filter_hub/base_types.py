"""slime.rollout.filter_hub.base_types: DynamicFilterOutput (the rollout manager's own class, so a filter's return
value is recognised as it is), slime's call_dynamic_filter and drop rule, and MetricGatherer for drop counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from services.rollout.generation.filters import DynamicFilterOutput, drop_metric


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    """Drop a rejected group, unless it asks to be kept when the batch would otherwise fall short."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


def call_dynamic_filter(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """fn's verdict as a DynamicFilterOutput: no filter keeps everything; a plain bool is `keep`."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if not isinstance(output, DynamicFilterOutput):
        output = DynamicFilterOutput(keep=output)
    return output


class MetricGatherer:
    """Counts drops by reason; collect() gives slime's rollout/dynamic_filter/drop_<reason> metrics."""

    def __init__(self) -> None:
        self._drops: Counter[str] = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict[str, int]:
        return {drop_metric(reason): count for reason, count in self._drops.items()}


__all__ = ["DynamicFilterOutput", "MetricGatherer", "call_dynamic_filter", "should_drop_dynamic_filter_output"]
