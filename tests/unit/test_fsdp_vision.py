"""The fsdp backend on a tiny Qwen2.5-VL and a tiny Qwen3-VL: a rollout's images reach the policy's forward, each
row's with it however the rollout is cut into micro-batches, its log-probs equal the HF model's own forward, and
training moves the vision tower unless freeze_vision holds it."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image as PILImage

from physarum import tasks
from physarum.tinyvlm import VLM_FAMILIES, build_tiny_vlm
from services.common.errors import InvalidArgument
from services.common.samples import Image, Sample
from services.rollout.generation.image_tokens import ImageTokens
from services.rollout.generation.prompts import PromptEncoder
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.settings.train import TrainConfig

KEYS = {"image": "images"}


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{request.param}"), tasks.corpus(), family=request.param)


def image(width: int, height: int, color: tuple[int, int, int]) -> Image:
    out = io.BytesIO()
    PILImage.new("RGB", (width, height), color).save(out, format="PNG")
    return Image(data=out.getvalue(), mime_type="image/png", width=width, height=height)


def vlm_samples(vlm_dir) -> list[Sample]:
    """Two groups of two samples with images (each group's samples share its list) and one text-only sample, their
    prompt tokens expanded as the rollout service expands them."""
    encoder = PromptEncoder(vlm_dir)
    tokens = ImageTokens.load(vlm_dir)
    out = []
    groups = [([image(60, 40, (255, 0, 0))], "<|vision_start|><|image_pad|><|vision_end|>how many?", ["1", "22"]),
              ([image(30, 90, (0, 0, 255)), image(56, 56, (0, 255, 0))],
               "<|vision_start|><|image_pad|><|vision_end|> or <|vision_start|><|image_pad|><|vision_end|>?",
               ["3", "45"])]
    for group_index, (images, text, responses) in enumerate(groups):
        prompt_ids = tokens.expand(encoder.encode_text(text), images, "test")
        for j, response in enumerate(responses):
            response_ids = encoder.encode_text(response)
            out.append(Sample(tokens=prompt_ids + response_ids, response_length=len(response_ids),
                              reward=float(j), group_index=group_index, index=j, images=images))
    text_ids, response_ids = encoder.encode_text("1+2="), encoder.encode_text("3")
    out.append(Sample(tokens=text_ids + response_ids, response_length=len(response_ids), reward=1.0, group_index=2))
    return out


def hf_log_probs(model_dir, sample: Sample, temperature: float) -> list[float]:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([sample.tokens])
    extra = {}
    if sample.images:
        pixels = AutoImageProcessor.from_pretrained(model_dir)(
            images=[PILImage.open(io.BytesIO(i.data)).convert("RGB") for i in sample.images], return_tensors="pt")
        extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
                 "mm_token_type_ids": (ids == model.config.image_token_id).to(torch.int32)}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0]
    log_softmax = torch.log_softmax(logits.float() / temperature, dim=-1)
    return [log_softmax[t - 1, sample.tokens[t]].item() for t in range(sample.prompt_length, len(sample.tokens))]


def make_backend(model_dir, **overrides) -> TorchBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-2, "multimodal_keys": KEYS, **overrides})
    return TorchBackend(model_dir, config, num_threads=1)


@pytest.mark.parametrize("batching", [{"micro_batch_size": 5}, {"micro_batch_size": 2},
                                      {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 40}])
def test_log_probs_equal_the_hf_forward_with_the_images_however_the_rollout_is_cut(vlm_dir, batching):
    samples = vlm_samples(vlm_dir)
    backend = make_backend(vlm_dir, rollout_temperature=0.7, **batching)
    got = backend.compute_log_probs(samples)
    for sample, log_probs in zip(samples, got, strict=True):
        assert log_probs == pytest.approx(hf_log_probs(vlm_dir, sample, 0.7), abs=1e-5)
    # the images matter: the same tokens with another group's images give other log-probs
    swapped = vlm_samples(vlm_dir)
    swapped[0].images = [image(60, 40, (0, 0, 0))]
    assert backend.compute_log_probs(swapped)[0] != pytest.approx(got[0], abs=1e-4)


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_training_moves_the_vision_tower_unless_frozen(vlm_dir, freeze_vision):
    samples = vlm_samples(vlm_dir)[:4]
    backend = make_backend(vlm_dir, micro_batch_size=2, freeze_vision=freeze_vision)
    for sample, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
        sample.rollout_log_probs = log_probs
    visual = {name: p.detach().clone() for name, p in backend.model.named_parameters() if ".visual." in f".{name}"}
    language = {name: p.detach().clone() for name, p in backend.model.named_parameters() if "language_model" in name}
    assert visual and language
    (metrics,) = backend.train_rollout(samples)
    assert metrics["train/grad_norm"] > 0
    after = dict(backend.model.named_parameters())
    assert any(not torch.equal(after[name], before) for name, before in language.items())
    moved = [name for name, before in visual.items() if not torch.equal(after[name], before)]
    assert (moved == []) == freeze_vision
    exported = dict(backend.named_weights())
    assert any(name.startswith("model.visual.") for name in exported)  # weight sync sends the vision tower too


def test_a_rollout_without_images_runs_as_text(vlm_dir):
    sample = vlm_samples(vlm_dir)[-1]
    backend = make_backend(vlm_dir, micro_batch_size=1)
    assert backend.compute_log_probs([sample])[0] == pytest.approx(hf_log_probs(vlm_dir, sample, 1.0), abs=1e-5)
    assert backend._images is None
    text_job = TorchBackend(vlm_dir, TrainConfig(n_samples_per_prompt=1), num_threads=1)
    assert text_job.image_processor is None
    with pytest.raises(InvalidArgument, match="no multimodal_keys"):
        text_job.compute_log_probs(vlm_samples(vlm_dir)[:1])


def test_a_sample_whose_image_tokens_its_images_do_not_make_is_refused_naming_both_counts(vlm_dir):
    """An observation's image tokens without the observation's image (a sample that lost its observation_images):
    a clear error, not the rope index running out of images."""
    from services.rollout.generation.image_tokens import ImageTokens

    first = vlm_samples(vlm_dir)[0]
    encoder, tokens = PromptEncoder(vlm_dir), ImageTokens.load(vlm_dir)
    seen = image(28, 56, (10, 200, 30))
    observation = tokens.expand(encoder.encode_text("<|vision_start|><|image_pad|><|vision_end|>"), [seen], "t")
    response = observation + encoder.encode_text("3")
    lost = Sample(tokens=first.tokens[:first.prompt_length] + response, response_length=len(response),
                  loss_mask=[0] * len(observation) + [1], group_index=0, images=list(first.images))
    backend = make_backend(vlm_dir, micro_batch_size=1)
    made = tokens.count(first.images[0])
    with pytest.raises(InvalidArgument, match=rf"rollout rows \[0\]: {made + tokens.count(seen)} image tokens, but "
                                              rf"their 1 images make {made} \(a sample's images are its group's"):
        backend.compute_log_probs([lost])


def test_the_weight_sync_names_every_engine_weight_the_vision_tower_included(vlm_dir):
    """The weights the trainer broadcasts are the CPU engine's by name (its update loads by state_dict name): the
    vision tower's reach the engine's vision tower."""
    from services.engine.generation import load_model

    backend = make_backend(vlm_dir)
    sent = {name: tuple(t.shape) for name, t in backend.named_weights()}
    engine_model, _ = load_model(str(vlm_dir))
    served = {name: tuple(t.shape) for name, t in engine_model.state_dict().items()}
    assert sent.items() <= served.items()
    visual = {name for name in served if name.startswith("model.visual.")}
    assert visual and visual <= set(sent)
    assert set(served) - set(sent) <= {"lm_head.weight"}  # a tied head is the embedding, sent once
