"""The trainer's default_train_backend (megatron on the Helm chart's cluster, fsdp locally) fills in the
train_backend of submitted specs that name none."""

from __future__ import annotations

import typing

import pytest

from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.trainer.api.config import TRAIN_BACKENDS, TrainerConfig
from services.trainer.api.spec import JobSpec
from services.trainer.api.spec_defaults import spec_defaults, spec_parser

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 1, "rollout_batch_size": 2}


def test_specs_without_a_backend_get_the_trainers_default():
    parse = spec_parser(spec_defaults(TrainerConfig(default_train_backend="megatron")))
    assert parse(BASE).train_backend == "megatron"
    assert parse({**BASE, "tensor_model_parallel_size": 2}).tensor_model_parallel_size == 2
    assert parse({**BASE, "train_backend": "fsdp"}).train_backend == "fsdp"  # the spec's own choice stands
    with pytest.raises(InvalidArgument, match="expected a mapping"):
        parse(["not", "a", "spec"])
    local = spec_parser(spec_defaults(TrainerConfig()))
    assert local(BASE).train_backend == "fsdp"
    with pytest.raises(InvalidArgument, match="need train_backend: megatron"):
        local({**BASE, "tensor_model_parallel_size": 2})


def test_default_train_backend_is_a_checked_setting(monkeypatch):
    assert set(TRAIN_BACKENDS) == set(typing.get_args(JobSpec.model_fields["train_backend"].annotation))
    monkeypatch.setenv("PHYSARUM_TRAINER_DEFAULT_TRAIN_BACKEND", "megatron")
    assert load_config(TrainerConfig, "trainer", argv=[]).default_train_backend == "megatron"
    with pytest.raises(ValueError, match="default_train_backend must be one of fsdp, megatron, got 'deepspeed'"):
        TrainerConfig(default_train_backend="deepspeed")
