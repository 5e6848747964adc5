"""Dynamic sampling filters (slime's --dynamic-sampling-filter-path): keep or drop a group once it is scored.

slime's contract: `fn(args, samples, **kwargs) -> DynamicFilterOutput | bool`, plus its two built-ins (DAPO's zero-std
filter and the variant that keeps a group rather than start another sampling round). What a drop means for the
buffer is the rollout loop's business (manager.py).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common import plugins
from services.common.errors import InvalidArgument
from services.common.samples import Sample

EXPECTED = "def fn(args, samples, **kwargs) -> DynamicFilterOutput | bool"
SLIME_MODULE = "slime.rollout.filter_hub.dynamic_sampling_filters"


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # counted as rollout/dynamic_filter/drop_<reason>
    keep_when_insufficient: bool = False  # keep it anyway when dropping would leave the batch short


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """DAPO's filter: keep a group whose rewards differ (std > 1e-6); a group of one sample has std 0."""
    rewards = [s.reward for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """check_reward_nonzero_std, but a zero-std group is kept when dropping it would need another sampling round."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


BUILTINS = {fn.__name__: fn for fn in (check_reward_nonzero_std, check_reward_nonzero_std_with_fallback)}


@functools.cache
def load_filter(path: str) -> Callable[..., Any]:
    """A built-in by name (or by its slime or Physarum import path), else the user's function by import path."""
    module, _, name = path.rpartition(".")
    if name in BUILTINS and module in ("", SLIME_MODULE, __name__):
        return BUILTINS[name]
    return plugins.load_function(path, flag="dynamic_sampling_filter_path", expected=EXPECTED, num_params=2)


def call_filter(fn: Callable[..., Any], args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """Run the filter; a plain bool (or anything with a truth value) means keep/drop without a reason."""
    output = fn(args, samples)
    if output is None:
        raise InvalidArgument(f"dynamic_sampling_filter_path {getattr(fn, '__qualname__', fn)} returned None; "
                              f"expected {EXPECTED}")
    if hasattr(output, "keep"):  # ours, or slime's own class when the user imports it
        return DynamicFilterOutput(keep=bool(output.keep), reason=getattr(output, "reason", None),
                                   keep_when_insufficient=bool(getattr(output, "keep_when_insufficient", False)))
    return DynamicFilterOutput(keep=bool(output))


def should_drop(output: DynamicFilterOutput, *, num_remaining: int, target: int) -> bool:
    """slime's rule. num_remaining counts the groups written, in flight, and this one."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and num_remaining <= target)


def drop_metric(reason: str | None) -> str:
    return f"rollout/dynamic_filter/drop_{reason or 'filtered'}"
