"""Qwen3.5, dense and MoE, as a vision-language model on fsdp (a tiny ...ForConditionalGeneration: gated delta-net
and full-attention layers, its vision tower): a job with images trains the whole model, its log-probs equal the HF
model's own forward with the images, training moves the tower, and the weight sync reaches the engine's vision
tower; a text job on the same checkpoint trains its language model, whose weights the engine serving it whole takes
by their causal-LM names."""

from __future__ import annotations

import pytest
import torch

from physarum import tasks
from physarum.tinyvlm import QWEN3_5_VLMS, build_tiny_vlm
from services.engine.generation import load_model
from services.engine.weights import language_model_aliases
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.settings.train import TrainConfig
from tests.unit.test_fsdp_vision import hf_log_probs, image, make_backend, vlm_samples


@pytest.fixture(scope="module", params=QWEN3_5_VLMS)
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{request.param}-vl"), tasks.corpus(), family=request.param)


@pytest.mark.parametrize("micro_batch_size", [5, 2])
def test_log_probs_equal_the_hf_forward_with_the_images(vlm_dir, micro_batch_size):
    samples = vlm_samples(vlm_dir)
    backend = make_backend(vlm_dir, rollout_temperature=0.7, micro_batch_size=micro_batch_size)
    assert type(backend.model).__name__.endswith("ForConditionalGeneration")
    got = backend.compute_log_probs(samples)
    for sample, log_probs in zip(samples, got, strict=True):
        assert log_probs == pytest.approx(hf_log_probs(vlm_dir, sample, 0.7), abs=1e-5)
    swapped = vlm_samples(vlm_dir)  # the images matter
    swapped[0].images = [image(60, 40, (0, 0, 0))]
    assert backend.compute_log_probs(swapped)[0] != pytest.approx(got[0], abs=1e-4)


def test_training_moves_the_tower_and_the_sync_reaches_the_engines(vlm_dir):
    samples = vlm_samples(vlm_dir)[:4]
    backend = make_backend(vlm_dir, micro_batch_size=2)
    for sample, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
        sample.rollout_log_probs = log_probs
    before = {name: t.clone() for name, t in backend.named_weights()}
    (metrics,) = backend.train_rollout(samples)
    assert metrics["train/grad_norm"] > 0
    sent = dict(backend.named_weights())
    moved = {name for name, t in sent.items() if not torch.equal(t, before[name])}
    assert any(n.startswith("model.visual.") for n in moved) and any(n.startswith("model.language_model.")
                                                                      for n in moved)
    engine_model, _ = load_model(str(vlm_dir))  # the directory holds its image processor: served whole
    served = {name: tuple(t.shape) for name, t in engine_model.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in sent.items()} == served


def test_a_text_job_trains_the_language_model_the_engine_takes_by_its_names(vlm_dir):
    text = TorchBackend(vlm_dir, TrainConfig(n_samples_per_prompt=1), num_threads=1)
    assert type(text.model).__name__.endswith("ForCausalLM")
    engine_model, _ = load_model(str(vlm_dir))
    params = language_model_aliases(engine_model.state_dict())
    for name, tensor in text.named_weights():
        assert tuple(params[name].shape) == tuple(tensor.shape), name
    assert params["model.embed_tokens.weight"] is params["model.language_model.embed_tokens.weight"]
