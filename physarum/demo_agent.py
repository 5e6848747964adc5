"""`make demo-agent`: an agent written against the `openai` client learns to use its tool through the whole service
loop on CPU.

The questions are a*b+c (a and b in 2..9, c in 100..899), which the tiny model cannot work out in its head; the
agent (examples/agent/solver.py) offers one tool, `solve`, that works out the question's arithmetic. Held-out reward
is measured three times (greedy, one agent session per question, through the rollout service's gateway): the model
as initialised; after a warm-up on conversations, half of which call `solve` and copy its result, half of which
answer in the head (a*b, the +c forgotten: always wrong), and on copy drills (a tool turn, then the answer copying
its result); after the GRPO job examples/agent/demo.yaml, whose reward is the right answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from physarum import stack

OUT_DIR = Path(".physarum/demo-agent")
JOB = Path("examples/agent/demo.yaml")
NUM_TRAIN, NUM_TEST, NUM_WARMUP, NUM_DRILLS = 200, 40, 64, 512
C_RANGE = (100, 899)  # every result has 3 digits: the answer's digits sit at one distance from the tool's
# the warm-up: minibatches of conversations and copy drills; at 1e-2 the copy drills do not fit (tried)
WARMUP_STEPS, WARMUP_BATCHES, WARMUP_LR = 600, (8, 32), 3e-3  # batches: conversations, drills
HIDDEN_SIZE = 128  # at 64 (head size 16) the copy drills reach ~40% of digits in 600 steps
# the session's response budget (examples/agent/demo.yaml's too): it counts the tool's turn as well as the model's,
# and a worked trajectory takes ~135 tokens; at 120 the answer after the tool's result was cut after ~3 tokens
MAX_RESPONSE_LEN = 160


def solved(a: int, b: int, c: int) -> dict:
    """A worked conversation: a call to `solve`, its result, the answer."""
    from examples.agent.build import question
    from examples.agent.solver import TOOL

    return {"tools": [TOOL], "messages": [
        {"role": "user", "content": question(a, b, c)["input"]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "solve", "arguments": {}}}]},
        {"role": "tool", "content": str(a * b + c)},
        {"role": "assistant", "content": f"The answer is {a * b + c}."}]}


def guessed(a: int, b: int, c: int) -> dict:
    """An answer without the tool, as a model doing the arithmetic in its head writes it: a*b, the +c dropped (always
    wrong, c >= 1)."""
    from examples.agent.build import question
    from examples.agent.solver import TOOL

    return {"tools": [TOOL], "messages": [{"role": "user", "content": question(a, b, c)["input"]},
                                          {"role": "assistant", "content": f"The answer is {a * b}."}]}


def build(out_dir: Path, seed: int, num_warmup: int = NUM_WARMUP,
          num_drills: int = NUM_DRILLS) -> tuple[Path, Path, Path, Path]:
    """The cold and warm models (the same initialisation) and the train and test questions."""
    from examples.agent.build import question, split_questions
    from examples.agent.model import build_agent_model

    warmup, train, test = split_questions(num_warmup + num_drills, NUM_TRAIN, NUM_TEST, seed, c_range=C_RANGE)
    # the same initialisation, no warm-up
    cold = build_agent_model(out_dir / f"cold-{seed}-{HIDDEN_SIZE}", seed=seed, hidden_size=HIDDEN_SIZE)
    conversations = [(solved if i % 2 == 0 else guessed)(*t) for i, t in enumerate(warmup[:num_warmup])]
    warm = build_agent_model(out_dir / f"solver-warm-{seed}-{num_warmup}-{num_drills}-{HIDDEN_SIZE}", seed=seed,
                             hidden_size=HIDDEN_SIZE,
                             conversations=conversations, drills=[solved(*t) for t in warmup[num_warmup:]],
                             warmup_steps=WARMUP_STEPS, batch_sizes=WARMUP_BATCHES, max_lr=WARMUP_LR)
    paths = []
    for name, rows in (("train", train), ("test", test)):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(question(*t)) + "\n" for t in rows))
        paths.append(path)
    return cold, warm, paths[0], paths[1]


def evaluate(state: dict, model_dir: Path, test_path: Path, name: str) -> float:
    """Held-out reward of the engines' current weights: one greedy agent session per question."""
    from services.common.settings.rollout import RolloutConfig
    from services.rollout.client import RolloutClient

    config = RolloutConfig(job_id=f"demo-agent-eval-{name}", rollout_batch_size=1, tokenizer_path=str(model_dir),
                           input_key="input", label_key="label", apply_chat_template=True,
                           eval_prompt_data=[f"calc={test_path.resolve()}"],
                           n_samples_per_eval_prompt=1, eval_temperature=0.0, rollout_max_response_len=MAX_RESPONSE_LEN,
                           agent_function_path="examples.agent.solver.agent", agent_timeout_s=300.0,
                           custom_rm_path="examples.agent.reward.reward")
    with RolloutClient(state["rollout_addr"], timeout_s=30.0) as client:
        metrics = client.run_eval(config, 0, "0", timeout_s=1200.0)
    return metrics["eval/calc"]


def run_job(state: dict, overrides: list[str]) -> list[dict]:
    from physarum.demo import run_job as run

    return run(state, JOB, overrides)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the models' initialisation, the questions and "
                                                            "the GRPO job")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="override a GRPO job key (KEY=VALUE)")
    parser.add_argument("--num-warmup", type=int, default=NUM_WARMUP, help="warm-up conversations (half call "
                                                                             "`solve`; changes the split)")
    parser.add_argument("--num-drills", type=int, default=NUM_DRILLS, help="copy drills in the warm-up (a tool "
                                                                             "result, then the answer copying it)")
    parser.add_argument("--check-warm", type=int, default=0, metavar="N",
                        help="only build the warm model and report, greedily on N held-out questions, how often it "
                             "calls `solve` and copies the tool's result (no services)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    start = time.monotonic()
    cold, warm, train, test = build(OUT_DIR, args.seed, args.num_warmup, args.num_drills)
    if args.check_warm:
        from examples.agent.warm_check import check_warm

        calls, copies = check_warm(warm, test, args.check_warm)
        print(f"warm model ({time.monotonic() - start:.0f} s): calls `solve` on {calls}/{args.check_warm}, copies "
              f"its result on {copies}/{args.check_warm} held-out questions")
        return 0
    options = dict(num_engines=args.engines, trainer_threads=1, plugin_allowlist="examples")
    cold_dir, work_dir = OUT_DIR / "stack-cold", OUT_DIR / "stack"  # apart: the first's engines may still be leaving
    state = stack.up(stack.StackOptions(work_dir=cold_dir, model_path=cold, **options))
    try:
        before = evaluate(state, cold, test, f"cold-{args.seed}")
    finally:
        stack.down(cold_dir)
    print(f"held-out reward of the cold model: {before:.3f}", flush=True)
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=warm, **options))
    try:
        warmed = evaluate(state, warm, test, f"warm-{args.seed}")
        print(f"held-out reward after the warm-up: {warmed:.3f}", flush=True)
        grpo_start = time.monotonic()
        events = run_job(state, [f"hf_checkpoint={warm.resolve()}", f"prompt_data={train.resolve()}",
                                 f"seed={args.seed}", f"rollout_seed={args.seed}", *args.set])
        rewards = [round(e["metrics"]["rollout/reward_mean"], 3) for e in events
                   if "rollout/reward_mean" in e["metrics"]]
        print(f"GRPO: {len(rewards)} rollouts in {time.monotonic() - grpo_start:.0f} s, rollout reward {rewards}",
              flush=True)
        after = evaluate(state, warm, test, f"grpo-{args.seed}")  # the job pushed its last weights to the engines
    finally:
        stack.down(work_dir)
    print(f"took {time.monotonic() - start:.0f} s")
    print(f"demo: reward {before:.3f} -> {warmed:.3f} (warm-up) -> {after:.3f} (GRPO)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
