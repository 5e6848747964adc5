"""compile_layers: the decoder layers torch.compile'd (inductor, on the CPU here) train as the eager ones on both
backends, every layer runs the same compiled code, and rollouts of other lengths reuse the compiled graphs instead of
compiling again."""

from __future__ import annotations

import pytest
import torch

from physarum import tasks, tinymodel
from services.common.samples import Sample
from services.trainer.backends import compiled_layers
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.settings.train import TrainConfig
from tests.tiny_samples import samples_of

ROLLOUTS = [[("1+2=", "3", 1.0), ("1+2=", "4", 0.0), ("12+34=", "46", 0.0), ("12+34=", "55", 1.0)],
            [("7+8=", "15", 1.0), ("7+8=", "1", 0.0), ("123+4=", "127", 1.0), ("123+4=", "12", 0.0)],
            [("9+9=", "18", 1.0), ("9+9=", "8", 0.0), ("30+45=", "75", 1.0), ("30+45=", "705", 0.0)]]


def _train(model_dir, rollouts: list[list[Sample]], compiled: bool, backend_name: str = "fsdp") -> list[dict]:
    config = TrainConfig(n_samples_per_prompt=2, lr=1e-3, micro_batch_size=4, entropy_coef=0.01,
                         compile_layers=compiled)
    if backend_name == "megatron":
        from services.trainer.backends.megatron.backend import MegatronBackend

        backend = MegatronBackend(model_dir, config, num_threads=1, min_padding_to_pack=0.0)
    else:
        backend = TorchBackend(model_dir, config, num_threads=1)
    out = []
    for samples in rollouts:
        (metrics,) = backend.train_rollout(samples)
        out.append({k: v for k, v in metrics.items() if not k.startswith("perf/")})
        out[-1]["log_probs"] = backend.compute_log_probs(samples)
    return out


@pytest.mark.slow  # inductor compiles on the CPU: minutes on two shared cores
def test_compiled_layers_train_as_eager_and_reuse_their_graphs(tiny_model_dir):
    rollouts = [samples_of(tiny_model_dir, rollout) for rollout in ROLLOUTS]
    eager = _train(tiny_model_dir, rollouts[:2], compiled=False) + _train(tiny_model_dir, rollouts[2:], compiled=False)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = _train(tiny_model_dir, rollouts[:2], compiled=True)
    after_two = compiled_layers.compiles_so_far()
    compiled += _train(tiny_model_dir, rollouts[2:], compiled=True)  # a new backend, other lengths
    print(f"graphs compiled: {after_two} after two rollouts, {compiled_layers.compiles_so_far()} after three")
    assert 0 < after_two <= compiled_layers.RECOMPILE_LIMIT
    assert compiled_layers.compiles_so_far() == after_two  # other lengths, the same graphs
    assert_same_training(compiled, eager)


def assert_same_training(compiled: list[dict], eager: list[dict]) -> None:
    for got, want in zip(compiled, eager, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key == "log_probs":
                assert [x for row in got[key] for x in row] == pytest.approx(
                    [x for row in value for x in row], abs=1e-5, rel=1e-4)
            else:
                assert got[key] == pytest.approx(value, abs=1e-5, rel=1e-4), key


NUM_LAYERS = 6


@pytest.mark.slow  # inductor compiles on the CPU: minutes on two shared cores
def test_megatron_compiled_layers_train_as_eager_and_share_one_compiled_forward(tmp_path):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # six layers: were each layer compiled apart, its forward would hold an entry per layer at least
    model_dir = tinymodel.build_tiny_model(tmp_path / "six-layers", tasks.corpus(), num_layers=NUM_LAYERS)
    rollouts = [samples_of(model_dir, rollout) for rollout in ROLLOUTS]
    eager = [out for part in (rollouts[:2], rollouts[2:])
             for out in _train(model_dir, part, compiled=False, backend_name="megatron")]
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = _train(model_dir, rollouts[:2], compiled=True, backend_name="megatron")
    after_two = compiled_layers.compiles_so_far()
    forwards = torch._dynamo.eval_frame._debug_get_cache_entry_list(TransformerLayer.forward.__code__)
    compiled += _train(model_dir, rollouts[2:], compiled=True, backend_name="megatron")  # other lengths
    print(f"graphs compiled: {after_two} after two rollouts, {compiled_layers.compiles_so_far()} after three; "
          f"{len(forwards)} compiled TransformerLayer.forward for {NUM_LAYERS} layers")
    # megatron-core leaves the graph inside a layer (packed rows' rotary lengths, a warning, viewless outputs): a
    # layer's forward is several graphs, compiled once for all the layers
    assert 0 < len(forwards) < NUM_LAYERS  # a compile per grad mode and layout, not per layer
    assert compiled_layers.compiles_so_far() == after_two > 0  # other lengths, the same graphs
    assert_same_training(compiled, eager)
