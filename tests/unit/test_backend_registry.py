"""Backends register themselves by their train_backend name, imported by that name when asked for; the driver builds
one without naming any."""

from __future__ import annotations

from typing import get_args

import pytest

from services.common.errors import InvalidArgument
from services.trainer.backends import registry
from services.trainer.backends.capabilities import BackendName
from services.trainer.backends.layout import LayoutConfig
from services.trainer.distributed.parallel import World
from services.trainer.settings.train import TrainConfig


def test_every_layout_backend_name_has_a_builder():
    assert registry.registered() == tuple(sorted(get_args(BackendName)))


def test_a_name_without_declared_capabilities_is_refused_at_registration():
    with pytest.raises(ValueError, match="backend 'deepspeed': declare its capabilities in capabilities.BACKENDS"):
        registry.register("deepspeed")


def test_megatron_refuses_a_world_its_layout_does_not_divide():
    layout = LayoutConfig(train_backend="megatron", tensor_model_parallel_size=2)
    with pytest.raises(InvalidArgument, match="1 trainer ranks are not a multiple of .* \\(2\\)"):
        registry.build_backend("/m", TrainConfig(), layout, World(), num_threads=1)


def test_an_unregistered_backend_is_named(monkeypatch):
    monkeypatch.setattr(registry, "_BUILDERS", {})
    with pytest.raises(InvalidArgument, match="train_backend 'fsdp' is not available in this trainer"):
        registry.build_backend("/m", TrainConfig(), LayoutConfig(), World(), num_threads=1)
