"""`make demo-vlm`: a tiny vision-language model learns which colour a square in an image is, through the whole
service loop on CPU: images from the prompt data through the buffer, the engines and the trainer.

Builds a tiny Qwen2.5-VL (physarum/tinyvlm.py) and the task's images on the spot (physarum/visual_task.py), starts
the local stack, measures held-out reward, runs an SFT warm-up job and a GRPO job from examples/demo-vlm/, measures
again, saves a reward curve, and stops what it started.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import logging
import sys
import time
from pathlib import Path

from physarum import stack, tasks
from physarum.cli import add_device_flags
from physarum.demo import job_overrides, train_and_measure
from physarum.tinyvlm import VLM_FAMILIES, build_tiny_vlm
from physarum.visual_task import write_colour_task

EXAMPLES = Path("examples/demo-vlm")
DEMO_DIR = Path(".physarum/demo-vlm")


def demo_vlm_model(seed: int = 0, family: str = "qwen2_5_vl") -> tuple[Path, Path]:
    """The tiny VLM (built when missing) and the task files the job files name; returns the model's directory and
    the held-out test set."""
    name = f"model-{family}" + (f"-seed{seed}" if seed else "")
    model_dir = build_tiny_vlm(DEMO_DIR / name, tasks.corpus(), family=family, seed=seed)
    _, _, test_path = write_colour_task(DEMO_DIR / "task")
    return model_dir, test_path


def evaluate(state: dict, model_dir: Path, test_path: Path, max_response_len: int = 8) -> float:
    """Held-out mean reward: greedy answers from each row's chat-rendered prompt and its image through the router,
    scored by the reward service."""
    import httpx
    from transformers import AutoTokenizer

    from services.common.samples import Sample
    from services.reward.client import RewardClient

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in test_path.read_text().splitlines()]

    def answer(row: dict) -> Sample:
        question = row["input"].replace("<image>", "")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        image = base64.b64encode((test_path.parent / row["images"][0]).read_bytes()).decode()
        body = {"input_ids": list(ids), "image_data": [f"data:image/png;base64,{image}"],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_response_len}}
        reply = httpx.post(f"{state['router_url']}/generate", json=body, timeout=120.0)
        reply.raise_for_status()
        return Sample(prompt=question, response=tokenizer.decode(reply.json()["output_ids"], skip_special_tokens=True),
                      label=row["label"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        samples = list(pool.map(answer, rows))
    with RewardClient(state["reward_addr"], timeout_s=60.0) as reward:
        scores = reward.score(samples, rm_type="exact_match", timeout_s=10.0)
    return sum(s.reward for s in scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's initialisation and of both jobs' shuffling and sampling")
    parser.add_argument("--set", action="append", default=[], help="override a GRPO job key (KEY=VALUE)")
    parser.add_argument("--sft-set", action="append", default=[],
                        help="override an SFT warm-up job key (KEY=VALUE), e.g. num_rollout=2 for a smoke run")
    parser.add_argument("--model-family", choices=VLM_FAMILIES, default="qwen2_5_vl",
                        help="the tiny vision-language model's family (default: qwen2_5_vl)")
    parser.add_argument("--trainer-threads", type=int, default=2,
                        help="torch threads of the trainer (1 is faster on a machine busy with other work)")
    add_device_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    start = time.monotonic()
    model_dir, test_path = demo_vlm_model(args.seed, args.model_family)
    sft_sets, grpo_sets = job_overrides([], args.seed, model_dir, args.sft_set, args.set)
    work_dir = DEMO_DIR / "stack"
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=model_dir, num_engines=args.engines,
                                        trainer_threads=args.trainer_threads, trainer_device=args.device,
                                        engine_device=args.engine_device))
    try:
        print(f"stack up in {time.monotonic() - start:.0f} s; job API {state['trainer_url']}/docs; model: tiny "
              f"{args.model_family}; task: which colour is the square? ({test_path.parent})", flush=True)
        before, after_sft, after = train_and_measure(
            state, lambda: evaluate(state, model_dir, test_path), EXAMPLES, (sft_sets, grpo_sets),
            DEMO_DIR / "reward_curve.png", "Physarum VLM demo: which colour is the square?")
    finally:
        stack.down(work_dir)
    print(f"demo: reward {before:.3f} -> {after_sft:.3f} (warm-up) -> {after:.3f} (GRPO)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
