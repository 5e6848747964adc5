"""A rollout of prompts with images, through the real buffer, reward, sglang-router and a CPU engine serving a tiny
Qwen2.5-VL: each group carries its prompt's images once, each sample's prompt tokens hold the image tokens the engine
expanded, and the engine's log-probs of the response are the HF model's own over those tokens and images."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
import torch
from PIL import Image

from physarum import tasks
from physarum.tinyvlm import build_tiny_vlm
from services.buffer.client import BufferClient
from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.settings.rollout import RolloutConfig
from services.reward.client import RewardClient
from services.rollout.client import RolloutState
from services.rollout.generation.manager import RolloutManager
from services.rollout.local import start_router
from services.rollout.pool.router import RouterClient
from testkit.engines import engine_healthy
from testkit.images import png

pytestmark = pytest.mark.slow  # a VLM engine, a router, buffer and reward per module


@pytest.fixture(scope="module")
def stack(redis_url, session_dir, tmp_path_factory):
    """buffer, reward, one VLM engine behind a round-robin router; stopped by PID at the end."""
    model = build_tiny_vlm(session_dir / "tiny-vlm", tasks.corpus())
    work = tmp_path_factory.mktemp("rollout-vision")
    started: list[procs.ManagedProcess] = []
    try:
        ports = {name: procs.free_port() for name in ("buffer", "reward", "engine", "router")}
        for name, args in (("buffer", ["--redis-url", redis_url]), ("reward", ["--rest-port", str(procs.free_port())]),
                           ("engine", ["--model-path", str(model)])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, "--port", str(ports[name]), *args)
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log").start())
        engine_url = f"http://{procs.HOST}:{ports['engine']}"
        started.append(start_router(ports["router"], procs.free_port(), work / "router.log", policy="round_robin"))
        started[2].wait_ready(lambda: engine_healthy(engine_url), timeout_s=120)
        router_url = f"http://{procs.HOST}:{ports['router']}"
        with RouterClient(router_url) as router:
            router.add_worker(engine_url, timeout_s=30)
        for name in ("buffer", "reward"):
            wait_for_health(f"{procs.HOST}:{ports[name]}", timeout_s=30)
        yield {"buffer_addr": f"{procs.HOST}:{ports['buffer']}", "reward_addr": f"{procs.HOST}:{ports['reward']}",
               "router": router_url, "work": work, "model": model}
    finally:
        for proc in reversed(started):
            proc.stop()


def hf_response_logprobs(model_dir, tokens: list[int], response_length: int, images: list[bytes],
                         temperature: float) -> list[float]:
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(model_dir)(
        images=[Image.open(io.BytesIO(i)).convert("RGB") for i in images], return_tensors="pt")
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(ids == model.config.image_token_id).to(torch.int32)).logits[0]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    start = len(tokens) - response_length
    return [float(logprobs[start - 1 + k, tokens[start + k]]) for k in range(response_length)]


def test_a_rollout_keeps_each_prompts_images_once_and_the_engines_image_tokens(stack):
    red, blue = png(60, 40, (255, 0, 0)), png(30, 90, (0, 0, 255))
    rows = [{"input": "<image>count red", "label": "1", "images": ["data:image/png;base64," +
                                                                  base64.b64encode(red).decode()]},
            {"input": "<image> vs <image>", "label": "2", "images": [base64.b64encode(blue).decode(),
                                                                     base64.b64encode(red).decode()]}]
    path = stack["work"] / "vlm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = "vlm-rollout"
    cfg = RolloutConfig(job_id=job, rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=5,
                        rm_type="exact_match", lease_timeout_s=60.0, multimodal_keys={"image": "images"})

    async def main():
        with BufferClient(stack["buffer_addr"], timeout_s=30.0) as buffer, \
                RewardClient(stack["reward_addr"], timeout_s=30.0) as reward:
            info = buffer.load_dataset(job, str(path), label_key="label", multimodal_keys=cfg.multimodal_keys)
            assert (info.num_prompts, info.num_skipped) == (2, 0), info.errors
            manager = RolloutManager(buffer, reward, stack["router"], model_path=str(stack["model"]))
            try:
                manager.start_rollout(cfg, 0, "v0")
                await asyncio.wait_for(asyncio.shield(manager.runs[(job, 0)].task), 120)
                status = manager.status(job, 0)
                assert status.state == RolloutState.DONE, status.error
            finally:
                await manager.close()
            return buffer.get_batch(job, 0, 2, timeout_s=30)

    groups = sorted(asyncio.run(main()), key=lambda g: g.prompt_index)
    image_token = json.loads((stack["model"] / "config.json").read_text())["image_token_id"]
    expected_images = [[red], [blue, red]]
    # resized to multiples of 28 with at least 56x56 pixels: 60x40 -> 84x56 (6x4 patches of 14, merged 2x2: 6 tokens),
    # 30x90 -> 56x112 (4x8 patches: 8 tokens)
    expected_runs = [[6], [8, 6]]
    for group, images, runs in zip(groups, expected_images, expected_runs, strict=True):
        assert [i.data for i in group.images] == images
        assert len(group.samples) == 2
        for sample in group.samples:
            prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
            assert [len(r) for r in "".join("x" if t == image_token else " " for t in prompt).split()] == runs
            assert 0 < sample.response_length == len(sample.rollout_log_probs)
            assert sample.rollout_log_probs == pytest.approx(hf_response_logprobs(
                stack["model"], sample.tokens, sample.response_length, images, 1.0), abs=1e-5)
