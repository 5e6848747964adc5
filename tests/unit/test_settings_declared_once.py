"""Each job setting is declared once: by one of the parts' config classes, whose default, help and rule the job
spec (and any part that shares the setting) takes from there."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from services.common.config import POSITIVE, check_fields, declared_in, field, own_settings, settings, shared
from services.common.settings.rollout import RolloutConfig
from services.trainer.api.spec import PARTS, JobSpec, parse_spec
from services.trainer.settings.train import TrainConfig

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 2, "rollout_batch_size": 4}


def declarations(classes) -> dict[str, set[str]]:
    """Each setting's name -> the classes that declare it (a shared field counts for its declaring class)."""
    out: dict[str, set[str]] = defaultdict(set)
    for cls in classes:
        for f in settings(cls):
            out[f.name].add(declared_in(cls, f).__name__)
    return out


def declared_twice(classes) -> dict[str, set[str]]:
    return {name: owners for name, owners in declarations(classes).items() if len(owners) > 1}


def test_no_job_setting_is_declared_in_two_config_classes():
    assert declared_twice(PARTS) == {}


def test_a_setting_declared_again_is_caught_and_a_shared_one_is_not():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Owner:
        size: int = field(1, "how many", POSITIVE)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Copier:
        size: int = field(1, "how many")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Sharer:
        size: int = shared(Owner, "size")

    assert declared_twice([Owner, Copier]) == {"size": {"Owner", "Copier"}}
    assert declared_twice([Owner, Sharer]) == {}
    with pytest.raises(ValueError, match="size must be > 0, got 0"):  # the owner's rule comes along
        check_fields(Sharer(size=0))


def test_the_job_spec_is_exactly_the_declared_settings_with_their_defaults_and_help():
    declared = {f.name: f for cls in PARTS for f in own_settings(cls)}
    assert set(JobSpec.model_fields) == set(declared)
    for name, f in declared.items():
        spec_field = JobSpec.model_fields[name]
        assert spec_field.description == f.metadata["help"], name
        if f.default is not dataclasses.MISSING:
            assert spec_field.default == f.default, name


def test_shared_settings_keep_their_owners_default_help_and_rule():
    rollout = {f.name: f for f in dataclasses.fields(RolloutConfig)}
    for f in dataclasses.fields(TrainConfig):
        if declared_in(TrainConfig, f) is RolloutConfig:
            assert (f.default, f.metadata) == (rollout[f.name].default,
                                               {**rollout[f.name].metadata, "declared_in": RolloutConfig})
    with pytest.raises(ValueError, match="n_samples_per_prompt must be > 0, got 0"):
        TrainConfig(n_samples_per_prompt=0)


def test_the_defaults_that_disagreed_are_one_value_now():
    spec = parse_spec(BASE)
    assert spec.label_key == spec.rollout.label_key == "label"  # slime's default
    assert spec.lease_timeout_s == spec.rollout.lease_timeout_s == 60.0  # the spec's user-facing default
    assert spec.n_samples_per_prompt == spec.rollout.n_samples_per_prompt == spec.train.n_samples_per_prompt == 1
