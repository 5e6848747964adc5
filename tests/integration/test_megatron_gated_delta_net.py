"""Qwen3.5 (qwen3_5 dense, qwen3_5_moe) and Qwen3-Next (qwen3_next) on the Megatron backend, over 2 gloo processes:
gated delta-net layers (the PyTorch scan here, on the CPU) among gated full-attention ones, zero-centered norms and
(MoE) a gated shared expert give the HF model's log-probs within 1e-5 at TP=1 (packed and padded rows), TP=2 (with
and without sequence parallelism), PP=2, EP=2, TP=2 × EP=2, expert TP=2 and context parallelism 2 (packed and padded:
the gated delta-nets gather each sequence over the CP group), and a GRPO rollout's two steps (loss,
grad norm, every metric) match TorchBackend's (fsdp) on the same model, as do Qwen3.5-MoE's and Qwen3-Next's at EP=2
under each kind of routing replay; the HF export holds TorchBackend's weights under transformers' names and loads into
transformers; a backend resumed from a TP=2 × EP=2 dist-checkpoint trains as if never stopped, and one given the
trained model's Megatron-LM torch_dist (slime's --load) holds its weights.

One launch of tests/integration/megatron_gdn_worker.py serves the tests here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration import family_parity
from tests.integration.family_parity import REPLAY_SETTINGS, max_diff
from tests.integration.megatron_gdn_worker import EXPORTED, FAMILY_LAYOUTS, REPLAYED, RESUMED
from tests.integration.workers import run_worker

RUNS = [(family, layout) for family, layouts in FAMILY_LAYOUTS.items() for layout in layouts]


def _varied(family_dir: Path, out: Path, family: str) -> Path:
    """The tiny family model with its norms (zero-centered ones too) away from their identity, so that a lost or
    mis-centered one shows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and tensor.dim() == 1:
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
    return family_parity.save_beside_tokenizer(model, family_dir, out / family)


@pytest.fixture(scope="module")
def model_dirs(family_model_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gdn-family-models")
    return {family: _varied(family_model_dir(family), out, family) for family in FAMILY_LAYOUTS}


@pytest.fixture(scope="module")
def results(model_dirs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-gdn")
    run_worker("tests.integration.megatron_gdn_worker", str(out), *map(str, model_dirs.values()),
               log_path=out / "worker.log", timeout_s=1200)
    return {**json.loads((out / "results.json").read_text()), "out": out}


@pytest.fixture(scope="module")
def torch_reference(model_dirs) -> dict:
    """TorchBackend's (the HF model's) runs of every family, and of the REPLAYED ones under each routing replay."""
    return family_parity.torch_reference(model_dirs, REPLAYED)


@pytest.mark.parametrize(("family", "layout"), RUNS)
def test_log_probs_and_grpo_steps_match_the_hf_model_on_torch_backend(results, torch_reference, family, layout):
    family_parity.assert_layout_run_matches(results[family][layout], torch_reference[family])


@pytest.mark.parametrize(("family", "layout"), sorted(EXPORTED))
def test_the_export_holds_the_torch_backend_weights_under_transformers_names(results, torch_reference, family,
                                                                            layout):
    save_dir = results["out"] / f"{family}-{layout}"
    saved = family_parity.assert_export_holds(save_dir, torch_reference[family]["weights"])
    family_parity.assert_transformers_loads(save_dir, saved)


@pytest.mark.parametrize(("family", "layout"), sorted(RESUMED))
def test_a_backend_resumed_from_a_dist_checkpoint_trains_as_if_never_stopped(results, family, layout):
    family_parity.assert_resumed_as_never_stopped(results[family][layout])


@pytest.mark.parametrize(("family", "layout"), sorted(RESUMED))
def test_megatron_lms_torch_dist_of_the_trained_model_loads_as_slimes_load(results, family, layout):
    """megatron-core's gated delta-net saves its projections split into named parts (query, key, ..., alpha)."""
    run = results[family][layout]
    assert max_diff(run["torch_dist_log_probs"], run["log_probs_after"]) < 1e-6


@pytest.mark.parametrize("setting", REPLAY_SETTINGS)
@pytest.mark.parametrize("family", REPLAYED)
def test_routing_replay_at_expert_parallelism_2_routes_as_the_torch_backend_does(results, torch_reference, family,
                                                                                 setting):
    family_parity.assert_replay_run_matches(results[family][setting], torch_reference[family], setting)
