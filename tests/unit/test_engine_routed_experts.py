"""The CPU engine reports the experts it routed each token to (SGLang's return_routed_experts) for tiny Qwen3-MoE and
GLM-4-MoE models:
from a left-padded batch with KV-cached decode, the same experts as an unpadded forward of the whole sequence; the
reply's meta_info.routed_experts becomes the sample's field, and replaying it on the trainer with the engine's weights
changes nothing. An engine without an MoE router refuses the option."""

from __future__ import annotations

import base64
import threading

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.engine.generation import Engine, Request, SamplingParams, load_model
from services.engine.protocol import parse_generate, to_response
from services.rollout.engine_calls.generate import append_reply
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.moe.hf_routing_replay import RoutingReplay
from services.trainer.settings.train import TrainConfig


def run(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[Request]:
    done = [threading.Event() for _ in prompts]
    requests = [Request(rid=f"r{i}", input_ids=list(prompt), on_finish=lambda r, e=event: e.set(),
                        params=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
                        return_routed_experts=True)
                for i, (prompt, event) in enumerate(zip(prompts, done, strict=True))]
    engine.submit(requests)
    assert all(event.wait(120) for event in done)
    return requests


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])  # softmax routers; sigmoid ones after a dense layer
def test_the_engine_reports_each_tokens_experts_and_the_trainer_replays_them(family_model_dir, family):
    model_dir = family_model_dir(family)
    model, tokenizer = load_model(str(model_dir))
    engine = Engine(model, tokenizer, max_batch_size=4, seed=3).start()
    try:
        prompts = [tokenizer.encode("12+34="), tokenizer.encode("1+2="), tokenizer.encode("7+8=")] * 2
        requests = run(engine, prompts, max_new_tokens=4)
    finally:
        engine.stop()
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replay = RoutingReplay(reference, reference.config.num_hidden_layers)
    samples = []
    for request in requests:
        reply = to_response(request, True, None)
        tokens = request.input_ids + request.output_ids
        experts = torch.frombuffer(bytearray(base64.b64decode(reply["meta_info"]["routed_experts"])),
                                   dtype=torch.int32).view(-1, replay.num_layers, replay.top_k)
        assert experts.shape[0] == len(tokens) - 1  # every token fed to the model; the last never is
        with torch.no_grad(), replay.recording() as recorded:
            reference(input_ids=torch.tensor([tokens[:-1]]))
        moe = [layer for layer, _ in replay.routers]  # a dense layer's entries are unused
        # the same experts per token (a sigmoid router's top-k is unsorted: the order is not compared)
        assert torch.equal(experts[:, moe].sort(-1).values, recorded[0][:, moe].sort(-1).values)
        sample = Sample(tokens=list(request.input_ids))
        append_reply(sample, reply)
        assert sample.rollout_routed_experts == experts.flatten().tolist()
        sample.loss_mask, sample.reward = [1] * sample.response_length, float(len(samples) % 2)
        samples.append(sample)

    def train(**overrides) -> list[dict[str, float]]:
        config = TrainConfig(n_samples_per_prompt=2, lr=1e-3, micro_batch_size=3, num_steps_per_rollout=2,
                             **overrides)
        return TorchBackend(model_dir, config, num_threads=1).train_rollout([Sample(**vars(s)) for s in samples])

    for replayed, plain in zip(train(use_rollout_routing_replay=True), train(), strict=True):
        for key in ("train/pg_loss", "train/ppo_kl", "train/grad_norm"):
            assert replayed[key] == pytest.approx(plain[key], abs=1e-6), key


def test_an_engine_without_an_moe_router_refuses_the_option(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir))
    engine = Engine(model, tokenizer)
    assert parse_generate({"input_ids": [1, 2, 3]}, engine).requests[0].return_routed_experts is False
    with pytest.raises(InvalidArgument, match="return_routed_experts: the engine's model has no MoE router"):
        parse_generate({"input_ids": [1, 2, 3], "return_routed_experts": True}, engine)
