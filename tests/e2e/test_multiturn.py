"""End to end: the shipped multi-turn example (examples/multiturn: a calculator tool) trains for two rollouts
through the whole stack, with calculator tokens masked out of the loss, and is evaluated after each rollout."""

from __future__ import annotations

from pathlib import Path

import yaml
from tokenizers import Tokenizer

from examples.multiturn import calculator
from examples.multiturn.build_dataset import write_dataset
from services.buffer.client import BufferClient
from services.common.samples import Sample
from tests.e2e.test_loop import run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multiturn"


def tool_spans(sample: Sample, tokenizer: Tokenizer) -> list[tuple[int, int]]:
    """Replay the example's protocol on the response: after every "=" the model wrote comes the calculator's
    answer to its turn. Returns the (start, end) response positions of the calculator tokens."""
    response = sample.tokens[sample.prompt_length:]
    spans, turn_start, i = [], 0, 0
    while i < len(response):
        i += 1
        if tokenizer.decode([response[i - 1]]) != calculator.CALL or len(spans) == calculator.MAX_CALLS:
            continue
        if i == len(response):
            break  # the budget ended with "=": a call answered with nothing, or no call at all
        turn = tokenizer.decode(response[turn_start:i])
        answer = tokenizer.encode(calculator.calculate(turn) + "\n", add_special_tokens=False).ids
        end = min(i + len(answer), len(response))
        assert response[i:end] == answer[:end - i], f"no calculator answer after {turn!r}"
        spans.append((i, end))
        turn_start = i = end
    return spans


def test_calculator_example_trains_with_tool_tokens_masked(local_stack, tiny_model_dir, tmp_path):
    train, test = write_dataset(tmp_path, num_train=40, num_test=4)
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec.update(job_id="e2e-multiturn", hf_checkpoint=str(tiny_model_dir), prompt_data=str(train), num_rollout=2,
                rollout_batch_size=8, n_samples_per_prompt=8, global_batch_size=64, rollout_max_response_len=64,
                eval_prompt_data=[f"calc={test}"], eval_interval=1, n_samples_per_eval_prompt=2,
                weight_sync_timeout_s=30.0, lease_timeout_s=60.0, rollout_timeout_s=300.0)
    job, events = run(local_stack, spec, timeout_s=400.0)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # The engines got the trainer's weights first: a log-prob mismatch would show if calculator tokens (log-prob 0
    # from the engine) counted in the loss.
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert all("eval/calc" in m and "eval/calc-pass@2" in m for m in steps)

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    with BufferClient(local_stack["buffer_addr"], timeout_s=30.0) as buffer:
        samples = [s for r in range(2) for g in buffer.get_batch(spec["job_id"], r, 8, timeout_s=5) for s in g.samples]
    assert len(samples) == 128
    num_tool_tokens = 0
    for sample in samples:
        n = sample.response_length
        tool = {t for start, end in tool_spans(sample, tokenizer) for t in range(start, end)}
        assert sample.loss_mask == [0 if t in tool else 1 for t in range(n)]
        assert all((lp == 0.0) == (t in tool) for t, lp in enumerate(sample.rollout_log_probs))
        assert len(tool_spans(sample, tokenizer)) <= sample.metadata.get("calculator_calls", 0) <= \
            len(tool_spans(sample, tokenizer)) + 1
        num_tool_tokens += len(tool)
    assert num_tool_tokens > 0  # the random tiny model calls the calculator about once in three samples
