"""Every decoder-only family the torch backend and the CPU engine claim, on tiny configs (2 layers, hidden 64): a
GRPO step's log-probs are the HF model's own forward, bf16 trains, the engine generates with the HF model's
log-probs from a left-padded batch, and the trainer's weights reach it (names, shapes, dtypes; tied and untied)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from services.common.samples import Sample
from services.engine.generation import Engine, Request, SamplingParams, load_model
from services.engine.weights import WeightUpdater
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.settings.train import TrainConfig
from services.trainer.weight_sync.weight_sync import write_snapshot
from tests.model_families import FAMILIES, TIED
from tests.tiny_samples import samples_of

# two groups of n = 2 of unequal lengths (9, 9, 6, 6 tokens): the batch is padded
ROLLOUT = [("12+34=", "46", 1.0), ("12+34=", "55", 0.0), ("1+2=", "3", 0.0), ("1+2=", "4", 1.0)]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_log_probs(model, tokens: list[int], start: int) -> list[float]:
    """log p(tokens[t] | tokens[:t]) for t >= start, from the model's own unpadded forward."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    log_softmax = torch.log_softmax(logits, dim=-1)
    return [log_softmax[t - 1, tokens[t]].item() for t in range(start, len(tokens))]


def make_backend(model_dir, **overrides) -> TorchBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-3, "micro_batch_size": 4, **overrides})
    return TorchBackend(model_dir, config, num_threads=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_grpo_step_sees_the_hf_models_own_log_probs(family_model_dir, family):
    model_dir = family_model_dir(family)
    samples = samples_of(model_dir, ROLLOUT)
    reference = hf_model(model_dir)
    expected = [hf_log_probs(reference, s.tokens, s.prompt_length) for s in samples]
    backend = make_backend(model_dir)
    for got, want in zip(backend.compute_log_probs(samples), expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    for sample, log_probs in zip(samples, expected, strict=True):
        sample.rollout_log_probs = log_probs  # what an engine serving the HF model reports
    before = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    (metrics,) = backend.train_rollout(samples)
    # the step's own forward (padded batch of 4) gives the HF model's log-probs
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in backend.model.named_parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_steps_train_in_bfloat16_near_float32(family_model_dir, family):
    model_dir = family_model_dir(family)
    samples = samples_of(model_dir, ROLLOUT)
    float32 = make_backend(model_dir).compute_log_probs(samples)
    for sample, log_probs in zip(samples, float32, strict=True):
        sample.rollout_log_probs = log_probs
    backend = make_backend(model_dir, bf16=True, global_batch_size=2)
    metrics = backend.train_rollout(samples)
    assert len(metrics) == 2 and all(math.isfinite(v) for step in metrics for v in step.values())
    # bf16 rounding moves the log-probs a little, not a lot; a float32 forward would give < 1e-5
    assert 1e-5 < metrics[0]["train/train_rollout_logprob_abs_diff"] < 0.1
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())  # float32 master weights


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[Request]:
    """Greedy requests submitted together, so the engine batches them (left-padded prefill, KV-cached decode)."""
    done = [threading.Event() for _ in prompts]
    requests = [Request(rid=f"r{i}", input_ids=list(prompt), on_finish=lambda r, e=event: e.set(),
                        params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
                for i, (prompt, event) in enumerate(zip(prompts, done, strict=True))]
    engine.submit(requests)
    assert all(event.wait(120) for event in done)
    return requests


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_serves_the_family_and_takes_the_trainers_weights(family_model_dir, family, tmp_path):
    model_dir = family_model_dir(family)
    model, tokenizer = load_model(str(model_dir))
    engine = Engine(model, tokenizer, max_batch_size=4).start()
    try:
        prompts = [tokenizer.encode("12+34="), tokenizer.encode("1+2=")]
        reference = hf_model(model_dir)
        for request in generate(engine, prompts, max_new_tokens=5):
            tokens = request.input_ids + request.output_ids
            assert len(request.output_logprobs) == 5
            assert request.output_logprobs == pytest.approx(hf_log_probs(reference, tokens, len(request.input_ids)),
                                                            abs=1e-4)
        # one GRPO step, then the weights as the trainer sends them: each once, under the engine's own names
        backend = make_backend(model_dir)
        samples: list[Sample] = samples_of(model_dir, ROLLOUT)
        backend.train_rollout(samples)
        sent = dict(backend.named_weights())
        updater = WeightUpdater(engine, timeout_s=30.0)
        served = {name: t for name, t in model.state_dict().items()}
        tied = {"lm_head.weight"} if family in TIED else set()
        assert set(sent) == set(served) - tied
        assert (served["lm_head.weight"].data_ptr() == served["model.embed_tokens.weight"].data_ptr()) == bool(tied)
        for name, tensor in sent.items():
            assert (tensor.shape, tensor.dtype) == (served[name].shape, served[name].dtype), name
        snapshot = write_snapshot(sent.items(), tmp_path, "1", base_model_dir=model_dir)
        updater.update_from_disk(snapshot, weight_version="1")
        assert engine.weight_version == "1"
        # the engine's forward is the trained model's: its greedy continuations score as the trainer scores them,
        # and no longer as the model it loaded
        continued = generate(engine, prompts, max_new_tokens=3)
        probe = [Sample(tokens=r.input_ids + r.output_ids, response_length=3) for r in continued]
        for request, log_probs in zip(continued, backend.compute_log_probs(probe), strict=True):
            assert request.output_logprobs == pytest.approx(log_probs, abs=1e-5)
            before = hf_log_probs(reference, request.input_ids + request.output_ids, len(request.input_ids))
            assert max(abs(a - b) for a, b in zip(before, log_probs, strict=True)) > 1e-4
    finally:
        engine.stop()
