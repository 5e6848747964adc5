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

from services.trainer.settings.train import TrainConfig
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from tests.integration.megatron_gdn_worker import EXPORTED, FAMILY_LAYOUTS, REPLAYED, RESUMED
from tests.integration.megatron_moe_families_worker import REPLAY_SETTINGS
from tests.integration.megatron_moe_worker import engine_routed
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
    model.save_pretrained(out / family)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (family_dir / name).exists():
            (out / family / name).write_bytes((family_dir / name).read_bytes())
    return out / family


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


def _clean(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


@pytest.fixture(scope="module")
def torch_reference(model_dirs) -> dict:
    """TorchBackend's (the HF model's) log-probs before and after the rollout, metrics and weights; and under each
    routing replay setting."""
    from services.trainer.backends.fsdp.backend import TorchBackend

    out = {}
    for family, model_dir in model_dirs.items():
        backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG), num_threads=1)
        rollout = grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0)
        before = backend.compute_log_probs(rollout)
        metrics = _clean(backend.train_rollout(rollout))
        out[family] = {"log_probs_before": before, "metrics": metrics,
                       "log_probs_after": backend.compute_log_probs(rollout), "weights": dict(backend.named_weights())}
        for setting in REPLAY_SETTINGS if family in REPLAYED else ():
            backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, **{setting: True}), num_threads=1)
            rollout = engine_routed(model_dir, grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0))
            out[family][setting] = {"metrics": _clean(backend.train_rollout(rollout)),
                                    "log_probs_after": backend.compute_log_probs(rollout)}
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def _assert_steps_match(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) == 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), step
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=1e-5, rel=1e-5), (step, key)


@pytest.mark.parametrize(("family", "layout"), RUNS)
def test_log_probs_and_grpo_steps_match_the_hf_model_on_torch_backend(results, torch_reference, family, layout):
    run, want = results[family][layout], torch_reference[family]
    assert max_diff(run["log_probs_before"], want["log_probs_before"]) <= 1e-5
    _assert_steps_match(run["metrics"], want["metrics"])
    assert abs(run["metrics"][1]["train/ppo_kl"]) > 1e-4  # the second step saw the policy the first one moved
    assert max_diff(run["log_probs_after"], want["log_probs_after"]) < 1e-4


@pytest.mark.parametrize(("family", "layout"), sorted(EXPORTED))
def test_the_export_holds_the_torch_backend_weights_under_transformers_names(results, torch_reference, family,
                                                                            layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    save_dir = results["out"] / f"{family}-{layout}"
    saved, want = load_file(save_dir / "model.safetensors"), torch_reference[family]["weights"]
    assert saved.keys() == want.keys()
    for name, weight in want.items():
        torch.testing.assert_close(saved[name], weight, atol=1e-4, rtol=0, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32)
    state = reloaded.state_dict()
    for name, weight in saved.items():
        assert torch.equal(state[name], weight), name


@pytest.mark.parametrize(("family", "layout"), sorted(RESUMED))
def test_a_backend_resumed_from_a_dist_checkpoint_trains_as_if_never_stopped(results, family, layout):
    run = results[family][layout]
    assert len(run["resumed_metrics"]) == len(run["second_metrics"]) == 2
    for got, want in zip(run["resumed_metrics"], run["second_metrics"], strict=True):
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-6, rel=1e-6), key


@pytest.mark.parametrize(("family", "layout"), sorted(RESUMED))
def test_megatron_lms_torch_dist_of_the_trained_model_loads_as_slimes_load(results, family, layout):
    """megatron-core's gated delta-net saves its projections split into named parts (query, key, ..., alpha)."""
    run = results[family][layout]
    assert max_diff(run["torch_dist_log_probs"], run["log_probs_after"]) < 1e-6


@pytest.mark.parametrize("setting", REPLAY_SETTINGS)
@pytest.mark.parametrize("family", REPLAYED)
def test_routing_replay_at_expert_parallelism_2_routes_as_the_torch_backend_does(results, torch_reference, family,
                                                                                 setting):
    got, want = results[family][setting], torch_reference[family][setting]
    _assert_steps_match(got["metrics"], want["metrics"])
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) < 1e-4
    if setting == "use_rollout_routing_replay":  # the engine's other routing changed the step
        plain = torch_reference[family]["metrics"][0]["train/grad_norm"]
        assert abs(want["metrics"][0]["train/grad_norm"] - plain) > 1e-3
