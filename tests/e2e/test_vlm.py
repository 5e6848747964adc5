"""End to end: a GRPO job on prompts with images through `physarum up`'s local stack, on fsdp and on megatron
(megatron's language model with transformers' vision tower), serving a tiny Qwen2.5-VL: the engines' log-probs equal
the trainer's recomputation over the same image tokens and pixels, and the engines end with the trainer's weights,
its vision tower's included; an agent job whose sessions send an image on a later turn trains the same way; the
dashboard shows each sample's images."""

from __future__ import annotations

import io
import json
import time

import pytest
from PIL import Image
from safetensors.torch import load_file

from physarum import stack, tasks
from physarum.tinyvlm import build_tiny_vlm
from services.buffer.client import BufferClient
from services.common.sglang import SGLangClient
from services.rollout.client import RolloutClient
from services.trainer.api.client import JobsRestClient
from tests.e2e.roots import stack_roots
from tests.e2e.test_dashboard import (  # noqa: F401 - browser: the dashboard test's Chromium fixture
    ARTIFACTS,
    _chromium_missing,
    browser,
    console_errors,
    sign_in,
    wait_for,
)
from tests.e2e.test_loop import run
from tests.plugins.agent_fns import OBSERVATION

pytestmark = pytest.mark.slow  # its own stack: buffer, reward, router, a VLM engine, the rollout service, the trainer

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


@pytest.fixture(scope="module")
def vlm_stack(session_dir):
    model = build_tiny_vlm(session_dir / "tiny-vlm", tasks.corpus())
    work_dir = session_dir / "vlm-stack"
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=model, num_engines=1, trainer_threads=1,
                                        path_roots=stack_roots(session_dir)))
    yield state, model
    stack.down(work_dir)


def write_color_task(path, num_prompts: int) -> None:
    """'which color?' over one image of a solid color each (files beside the dataset), answered by its name."""
    rows = []
    for i in range(num_prompts):
        name = list(COLORS)[i % len(COLORS)]
        image = path.parent / f"{i}.png"
        Image.new("RGB", (40 + 8 * i, 56), COLORS[name]).save(image, format="PNG")
        rows.append({"input": "<image>which color?", "label": name, "images": [image.name]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("train_backend", ["fsdp", "megatron"])
def test_a_vlm_grpo_job_trains_on_images_end_to_end(vlm_stack, tmp_path, train_backend):
    state, model = vlm_stack
    data = tmp_path / "colors.jsonl"
    write_color_task(data, 4)
    spec = {"hf_checkpoint": str(model), "prompt_data": str(data), "multimodal_keys": {"image": "images"},
            "apply_chat_template": True, "train_backend": train_backend, "num_rollout": 2, "rollout_batch_size": 2,
            "n_samples_per_prompt": 2, "global_batch_size": 4, "rollout_max_response_len": 4,
            "rm_type": "exact_match", "lr": 1e-3, "rollout_temperature": 1.0, "weight_sync_timeout_s": 60.0,
            "lease_timeout_s": 60.0, "rollout_timeout_s": 300.0, "job_id": f"e2e-vlm-{train_backend}",
            "save_hf": str(tmp_path / "final")}
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        job = client.submit(spec)
        deadline = time.monotonic() + 600
        while (job := client.get(job["job_id"]))["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, f"job {job['job_id']} still {job['state']}"
            time.sleep(1.0)
        events = client.events(job["job_id"])
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # the engine generated from the images, the trainer recomputed with them: the same log-probs
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert (tmp_path / "final" / "preprocessor_config.json").is_file()  # the export keeps the image processor
    final = load_file(tmp_path / "final" / "model.safetensors")
    # fsdp's export keeps the checkpoint's own names (Qwen2.5-VL's: visual.*), megatron's and the engine's are the
    # model's in memory (model.visual.*)
    saved = next(n for n in sorted(final) if "visual." in n and n.endswith("attn.qkv.weight"))
    name = saved if saved.startswith("model.") else f"model.{saved}"
    loaded = load_file(model / "model.safetensors")
    assert not loaded[name.removeprefix("model.") if name not in loaded else name].equal(final[saved])  # trained
    with RolloutClient(state["rollout_addr"]) as rollout:
        engines, _ = rollout.list_engines()
    for engine in engines:
        with SGLangClient(engine.url) as client:
            assert client.model_info()["weight_version"] == "2"  # each job's own two rollouts
            got = client.get_weights_by_name(name, truncate_size=64)
            assert got == pytest.approx(final[saved].flatten()[:64].tolist(), abs=1e-7)


@pytest.mark.parametrize("train_backend", ["fsdp", "megatron"])
def test_an_agent_job_on_images_trains_on_the_images_its_sessions_send(vlm_stack, tmp_path, train_backend):
    """tests.plugins.agent_fns.image_agent sends its prompt's messages (their image in them), then an observation with
    an image of its own: one prompt through the openai client, the other through the anthropic one. The samples hold
    both images' tokens, the observation's untrained; the trainer's log-probs over them are the engine's."""
    state, model = vlm_stack
    data = tmp_path / "colors.jsonl"
    write_color_task(data, 2)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps({**row, "metadata": {"api": api}}) + "\n"
                            for row, api in zip(rows, ("openai", "anthropic"), strict=True)))
    spec = {"hf_checkpoint": str(model), "prompt_data": str(data), "multimodal_keys": {"image": "images"},
            "apply_chat_template": True, "train_backend": train_backend, "num_rollout": 2, "rollout_batch_size": 2,
            "n_samples_per_prompt": 2, "global_batch_size": 4, "rollout_max_response_len": 64,
            "agent_function_path": "tests.plugins.agent_fns.image_agent", "rm_type": "exact_match", "lr": 1e-3,
            "rollout_temperature": 1.0, "weight_sync_timeout_s": 60.0, "lease_timeout_s": 120.0,
            "rollout_timeout_s": 300.0, "job_id": f"e2e-vlm-agent-{train_backend}"}
    job, events = run(state, spec, timeout_s=600.0)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # before and after a weight sync: the engine read both images' tokens as the trainer does
    diffs = [step["train/train_rollout_logprob_abs_diff"] for step in steps]
    print(f"agent on images, {train_backend}: train_rollout_logprob_abs_diff per step {diffs}")
    assert all(diff < 1e-3 for diff in diffs), diffs
    image_token = json.loads((model / "config.json").read_text())["image_token_id"]
    with BufferClient(state["buffer_addr"], timeout_s=30.0) as buffer:
        groups = [g for r in range(2) for g in buffer.get_batch(spec["job_id"], r, 2, timeout_s=5)]
    apis = set()
    for group in groups:
        (prompt_image,) = group.images  # the prompt's image, once for its group
        for sample in group.samples:
            apis.add(sample.metadata["api"])
            assert sample.metadata["agent_turns"] == 2 and sample.metadata["agent_branches"] == []
            first, second = sample.metadata["agent_transcript"]["turns"]  # as the dashboard shows the session
            assert first["messages"][-1]["text"] == "which color? [1 image]"
            assert second["messages"] == [{"role": "user", "text": "and this one? [1 image]"}] and second["trained"]
            (observed,) = sample.observation_images
            assert observed.data != prompt_image.data and (observed.width, observed.height) == (36, 28)
            assert Image.open(io.BytesIO(observed.data)).getpixel((0, 0)) == OBSERVATION
            runs = "".join("x" if t == image_token else " " for t in sample.tokens).split()
            assert len(runs) == 2  # the prompt's image, then the observation's
            response = sample.tokens[sample.prompt_length:]
            masked = [t for t, m in zip(response, sample.loss_mask, strict=True) if m == 0]
            assert masked.count(image_token) == len(runs[1])  # the observation's image is never trained
            assert image_token not in [t for t, m in zip(response, sample.loss_mask, strict=True) if m == 1]
    assert apis == {"openai", "anthropic"}


@pytest.mark.skipif(bool(_chromium_missing()), reason=_chromium_missing() or "-")
def test_the_dashboard_shows_a_vlm_samples_images_beside_its_text(vlm_stack, browser, tmp_path):  # noqa: F811
    """One rollout of a job on images; the dashboard (in headless Chromium) shows each sample's image as a picture
    next to its prompt, whose text marks where the image stands."""
    state, model = vlm_stack
    url = state["trainer_url"]
    data = tmp_path / "colors.jsonl"
    write_color_task(data, 2)
    spec = {"hf_checkpoint": str(model), "prompt_data": str(data), "multimodal_keys": {"image": "images"},
            "apply_chat_template": True, "num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
            "global_batch_size": 4, "rollout_max_response_len": 4, "rm_type": "exact_match",
            "weight_sync_timeout_s": 60.0, "lease_timeout_s": 60.0, "rollout_timeout_s": 300.0,
            "job_id": "e2e-vlm-dashboard"}
    with JobsRestClient(url, timeout_s=30) as client:
        client.submit(spec)
    sign_in(browser, url, "")
    browser.get(url + "/dashboard/#/job/e2e-vlm-dashboard")
    shown = wait_for("a sample's image", lambda: browser.execute_script("""
        const img = document.querySelector("#samples .sample img.sample-image");
        if (!img || !img.complete) return null;
        const card = img.closest(".sample");
        return {width: img.naturalWidth, height: img.naturalHeight, src: img.src.slice(0, 22),
                prompt: card.querySelector(".turn.prompt").textContent};"""))
    assert shown["src"] == "data:image/png;base64," and shown["width"] > 0 and shown["height"] > 0, shown
    assert "[image 1]which color?" in shown["prompt"], shown
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.execute_script("document.querySelector('#samples').scrollIntoView()")
    shot = ARTIFACTS / "dashboard-vlm.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")
    errors = console_errors(browser)
    assert not errors, errors
