"""slime.rollout.data_source: slime's DataSource interface and its two classes, reading the job's prompts from the
Physarum buffer (through the rollout service, which builds the data source of a job with rollout_function_path).

RolloutDataSource leases prompts for the rollout being generated and returns them as groups of n_samples_per_prompt
Samples. RolloutDataSourceWithBuffer keeps the groups given back with add_samples (partial or aborted ones) in
`self.buffer`, holding their prompts' leases, and takes them out first through the buffer filter
(--buffer-filter-path, slime's pop_first by default). save and load are slime's hooks for a subclass's own state:
the buffer's own state is saved with the trainer's checkpoints.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

from services.rollout.generation.data_source import prompts_for
from services.rollout.generation.rollout_function import load_buffer_filter
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


class DataSource(abc.ABC):
    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Return num_samples samples"""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Add samples to the data source"""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Save the state of the data source"""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Load the state of the data source"""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Length of the data source. May change when samples are added/fetched."""


class RolloutDataSource(DataSource):
    """The job's prompt dataset, as the buffer serves it (returned prompts first, then its epoch order)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.metadata: dict[str, Any] = {}
        self._prompts = prompts_for(args)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return self._prompts.lease_groups(num_samples, self.args.n_samples_per_prompt)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"Cannot add samples to {self.__class__.__name__}. This is a read-only data source.")

    def save(self, rollout_id: int) -> None:
        pass  # the buffer's cursor, epoch and leases are saved with the trainer's checkpoints

    def load(self, rollout_id: int | None = None) -> None:
        pass

    def __len__(self) -> int:
        return self._prompts.num_prompts()


class RolloutDataSourceWithBuffer(RolloutDataSource):
    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter = load_buffer_filter(path) if path else pop_first

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        samples = self._get_samples_from_buffer(num_samples)
        num_samples -= len(samples)
        if num_samples == 0:
            return samples
        samples += super().get_samples(num_samples=num_samples)
        return samples

    def _get_samples_from_buffer(self, num_samples: int) -> list[list[Sample]]:
        if len(self.buffer) == 0 or num_samples == 0:
            return []
        # slime passes rollout_id None here; the rollout being generated is passed instead
        samples = self.buffer_filter(self.args, self._prompts.rollout_id, self.buffer, num_samples)
        self._prompts.take(samples)
        return samples

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Add sample groups to the buffer; they keep their prompts' leases."""
        if not samples:
            return
        assert isinstance(samples, list), f"samples must be a list, got {type(samples)}"
        assert isinstance(samples[0], list), f"the elements of samples must be list, got {type(samples[0])}"
        for group in samples:
            assert len(group) == self.args.n_samples_per_prompt, (
                f"the length of the elements of samples must be equal to n_samples_per_prompt, got {len(group)} != "
                f"{self.args.n_samples_per_prompt}")
            self.buffer.append(group)
        self._prompts.keep(samples)

    def update_metadata(self, metadata: dict) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict:
        return self.metadata

    def get_buffer_length(self) -> int:
        return len(self.buffer)


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    return samples


__all__ = ["DataSource", "RolloutDataSource", "RolloutDataSourceWithBuffer", "pop_first"]
