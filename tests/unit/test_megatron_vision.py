"""The megatron backend on a tiny Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE): megatron's language model with
transformers' vision tower. Log-probs equal the HF model's own forward with the images, packed or padded, however
the rollout is cut; the multimodal positions are the HF rope index's; training moves the tower unless
freeze_vision holds it; the weights go out under the engine's names, the tower's included (and as an HF export with
its image processor); a torch_dist checkpoint restores the tower; an image token sampled in a response is text to
both trainers."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image as PILImage

from physarum import tasks
from physarum.tinyvlm import QWEN3_5_VLMS, VLM_FAMILIES, build_tiny_vlm
from services.common.samples import Sample
from services.trainer.backends.megatron.backend import MegatronBackend
from services.trainer.batching import vision
from services.trainer.settings.train import TrainConfig
from tests.unit.test_fsdp_vision import KEYS, hf_log_probs, image, vlm_samples


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{request.param}"), tasks.corpus(), family=request.param)


def make_backend(model_dir, *, pack: bool = True, **overrides) -> MegatronBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-2, "multimodal_keys": KEYS, **overrides})
    return MegatronBackend(model_dir, config, num_threads=1, pack_sequences=pack, min_padding_to_pack=0.0)


def test_multimodal_positions_are_the_hf_rope_index(vlm_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    processor = vision.load_image_processor(vlm_dir)
    samples = vlm_samples(vlm_dir)
    images = vision.RolloutImages(processor, samples)
    for i, sample in enumerate(samples):
        ids = torch.tensor([sample.tokens])
        rows = [images.rows[i]]
        grid = rows[0].image_grid_thw if rows[0] is not None else None
        expected, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                                 image_grid_thw=grid)
        got = vision.multimodal_positions(ids, [len(sample.tokens)], rows, image_token_id=model.config.image_token_id,
                                          merge_size=model.config.vision_config.spatial_merge_size)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", [{"pack": True, "micro_batch_size": 5}, {"pack": False, "micro_batch_size": 2},
                                    {"pack": True, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 40}])
def test_log_probs_equal_the_hf_forward_with_the_images(vlm_dir, layout):
    samples = vlm_samples(vlm_dir)
    backend = make_backend(vlm_dir, rollout_temperature=0.7, **layout)
    try:
        got = backend.compute_log_probs(samples)
        for sample, log_probs in zip(samples, got, strict=True):
            assert log_probs == pytest.approx(hf_log_probs(vlm_dir, sample, 0.7), abs=1e-5)
        swapped = vlm_samples(vlm_dir)  # the images matter
        swapped[0].images = [image(60, 40, (0, 0, 0))]
        assert backend.compute_log_probs(swapped)[0] != pytest.approx(got[0], abs=1e-4)
    finally:
        backend.close()


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_training_moves_the_vision_tower_unless_frozen_and_sync_sends_it(vlm_dir, freeze_vision, tmp_path):
    from services.engine.generation import load_model

    samples = vlm_samples(vlm_dir)[:4]
    backend = make_backend(vlm_dir, micro_batch_size=2, freeze_vision=freeze_vision)
    try:
        for sample, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
            sample.rollout_log_probs = log_probs
        before = {name: t.clone() for name, t in backend.named_weights()}
        (metrics,) = backend.train_rollout(samples)
        assert metrics["train/grad_norm"] > 0
        after = dict(backend.named_weights())
        moved = {name for name, t in after.items() if not torch.equal(t, before[name])}
        assert any(name.startswith("model.language_model.") for name in moved)
        assert any(name.startswith("model.visual.") for name in moved) != freeze_vision
        # the engine loads what the trainer sends by state_dict name: every engine weight, the tower's included
        engine_model, _ = load_model(str(vlm_dir))
        served = {name: tuple(t.shape) for name, t in engine_model.state_dict().items()}
        sent = {name: tuple(t.shape) for name, t in after.items()}
        assert sent == served
        # the HF export is a whole vision-language model directory, image processor included, with those weights
        backend.save_hf(tmp_path / "hf")
        exported, _ = load_model(str(tmp_path / "hf"))
        assert (tmp_path / "hf" / "preprocessor_config.json").is_file()
        assert all(torch.equal(t, after[name]) for name, t in exported.state_dict().items())
    finally:
        backend.close()


def test_a_torch_dist_checkpoint_holds_the_vision_tower(vlm_dir, tmp_path):
    """megatron-core's dist checkpoint of a trained VLM (the tower inside the GPTModel) restores its log-probs
    exactly in a fresh backend."""
    samples = vlm_samples(vlm_dir)[:4]
    backend = make_backend(vlm_dir, micro_batch_size=2)
    try:
        for sample, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
            sample.rollout_log_probs = log_probs
        backend.train_rollout(samples)
        backend.save_sharded(tmp_path / "ckpt", rollout_id=1)
        trained = backend.compute_log_probs(samples)
    finally:
        backend.close()
    fresh = make_backend(vlm_dir, micro_batch_size=2)
    try:
        assert fresh.compute_log_probs(samples) != trained
        assert fresh.load_sharded(tmp_path / "ckpt") == {"model", "optim"}
        assert fresh.compute_log_probs(samples) == trained
    finally:
        fresh.close()


def decoded_log_probs(model_dir, sample: Sample) -> list[float]:
    """The engine's reading of a sample: the prompt with its images in one forward, then each response token fed
    to the HF model's cache as text (an image token a policy sampled is a token like any other)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([sample.tokens[:sample.prompt_length]])
    response = sample.tokens[sample.prompt_length:]
    pixels = AutoImageProcessor.from_pretrained(model_dir)(
        images=[PILImage.open(io.BytesIO(i.data)).convert("RGB") for i in sample.images], return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=prompt, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                    mm_token_type_ids=(prompt == model.config.image_token_id).int(), use_cache=True)
        log_probs = [torch.log_softmax(out.logits[0, -1], -1)[response[0]].item()]
        for token, following in zip(response, response[1:], strict=False):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True,
                        mm_token_type_ids=torch.zeros(1, 1, dtype=torch.int))
            log_probs.append(torch.log_softmax(out.logits[0, -1], -1)[following].item())
    return log_probs


@pytest.mark.parametrize("backend_name", ["megatron", "fsdp"])
def test_an_image_token_sampled_in_a_response_is_text(vlm_dir, backend_name):
    """An untrained policy may sample the image token: the engine read it as text, and so do both trainers (only
    the prompt's image tokens take the image's features and grid positions)."""
    from tests.unit.test_fsdp_vision import make_backend as make_fsdp_backend

    image_token = json.loads((vlm_dir / "config.json").read_text())["image_token_id"]
    first, second = vlm_samples(vlm_dir)[:2]
    response = [5, image_token, 7, image_token]
    sampled = Sample(tokens=first.tokens[:first.prompt_length] + response, response_length=len(response),
                     group_index=0, images=first.images, reward=1.0)
    backend = make_backend(vlm_dir, micro_batch_size=2) if backend_name == "megatron" else \
        make_fsdp_backend(vlm_dir, micro_batch_size=2)
    try:
        got = backend.compute_log_probs([sampled, second])[0]
    finally:
        if backend_name == "megatron":
            backend.close()
    assert got == pytest.approx(decoded_log_probs(vlm_dir, sampled), abs=1e-5)


@pytest.fixture(scope="module", params=QWEN3_5_VLMS)
def qwen3_5_dir(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{request.param}-vl"), tasks.corpus(), family=request.param)


def test_qwen3_5_with_images_is_its_vision_language_model(qwen3_5_dir):
    """Qwen3.5, dense and MoE (megatron's gated delta-net language model), for a job with images: the vision tower
    beside it, a quarter of each head turned by interleaved multimodal positions; log-probs equal the HF forward,
    packed and padded; training moves the tower, whose weights reach the engine's."""
    from services.engine.generation import load_model

    samples = vlm_samples(qwen3_5_dir)
    want = [hf_log_probs(qwen3_5_dir, sample, 1.0) for sample in samples]
    for pack in (False, True):
        backend = make_backend(qwen3_5_dir, pack=pack, micro_batch_size=2)
        try:
            assert backend.arch.vision_model_type == backend.arch.model_type and backend.arch.mrope_interleaved
            for got, expected in zip(backend.compute_log_probs(samples), want, strict=True):
                assert got == pytest.approx(expected, abs=1e-5)
            if not pack:
                continue
            for sample, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
                sample.rollout_log_probs = log_probs
            before = {name: t.clone() for name, t in backend.named_weights()}
            backend.train_rollout(samples[:4])
            after = dict(backend.named_weights())
        finally:
            backend.close()
    assert any(name.startswith("model.visual.") and not torch.equal(t, before[name]) for name, t in after.items())
    engine_model, _ = load_model(str(qwen3_5_dir))
    assert {n: tuple(t.shape) for n, t in after.items()} == {n: tuple(t.shape)
                                                              for n, t in engine_model.state_dict().items()}


@pytest.mark.parametrize("backend_name", ["megatron", "fsdp"])
def test_an_observation_image_in_a_response_is_an_image(vlm_dir, backend_name):
    """A multi-turn sample (slime's geo3k_vlm_multi_turn): an environment's observation with an image inside the
    response, its tokens untrained (loss_mask 0). Its image tokens take the observation image's features and grid
    positions, as the engine read the whole context on the next turn: the trainers' log-probs are the HF model's
    over the sample with every image, and an image token the policy sampled beside it stays text."""
    from services.rollout.generation.image_tokens import ImageTokens
    from services.rollout.generation.prompts import PromptEncoder
    from tests.unit.test_fsdp_vision import make_backend as make_fsdp_backend

    encoder, tokens = PromptEncoder(vlm_dir), ImageTokens.load(vlm_dir)
    first, second = vlm_samples(vlm_dir)[:2]
    seen = image(28, 56, (10, 200, 30))
    observation = tokens.expand(encoder.encode_text("<|vision_start|><|image_pad|><|vision_end|>look"), [seen], "t")
    turn1, turn2 = encoder.encode_text("12"), encoder.encode_text("3")
    response = turn1 + observation + turn2
    multi_turn = Sample(tokens=first.tokens[:first.prompt_length] + response, response_length=len(response),
                        loss_mask=[1] * len(turn1) + [0] * len(observation) + [1] * len(turn2), group_index=0,
                        images=[*first.images, seen], reward=1.0)
    backend = make_backend(vlm_dir, micro_batch_size=2) if backend_name == "megatron" else \
        make_fsdp_backend(vlm_dir, micro_batch_size=2)
    try:
        got = backend.compute_log_probs([multi_turn, second])[0]
        blind = Sample(**{**multi_turn.__dict__, "images": [*first.images, image(28, 56, (0, 0, 0))]})
        other = backend.compute_log_probs([blind, second])[0]
    finally:
        if backend_name == "megatron":
            backend.close()
    assert got == pytest.approx(hf_log_probs(vlm_dir, multi_turn, 1.0), abs=1e-5)
    after = len(turn1) + len(observation)  # the observation image's pixels reach the turn after it
    assert other[:len(turn1)] == pytest.approx(got[:len(turn1)], abs=1e-6)
    assert other[after:] != pytest.approx(got[after:], abs=1e-4)
