"""Multi-turn tool use: the model works out arithmetic with a calculator (slime's custom generate contract).

Each model turn ends at "=" — a calculator call: the calculator evaluates the arithmetic the turn wrote and answers
with the result and a newline — or at end-of-sequence, the final answer. The calculator's tokens are appended with
loss_mask 0 and log-prob 0 (the policy did not produce them); the model's with loss_mask 1 and their log-probs.
With partial_rollout, an aborted sample comes back here with its tokens and picks up where it stopped.

Job keys (examples/multiturn/job.yaml):
    custom_generate_function_path: examples.multiturn.calculator.generate
    custom_rm_path: examples.multiturn.calculator.reward
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# `generate` runs in the rollout manager, `reward` in the reward service, whose image has neither tokenizers nor the
# manager's generation code: what `generate` needs is imported when it runs.

CALL = "="  # a turn ending here is a calculator call
MAX_CALLS = 3  # after this many calls the model only gets to answer
MAX_EXPRESSION_CHARS = 64
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EXPRESSION = re.compile(r"[0-9+\-*/(). ]*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculate(turn: str) -> str:
    """The calculator: the arithmetic (+ - * / and parentheses) at the end of a turn, evaluated; "error" if none."""
    expression = _EXPRESSION.search(turn.removesuffix(CALL)).group().strip()
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return "error"
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


@functools.cache
def _tokenizer(model_path: str) -> Tokenizer:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


async def generate(args, sample, sampling_params):
    """Alternate model turns and calculator answers until the model ends its answer or the budget is spent."""
    from services.rollout.engine_calls.generate import append_reply, router_generate

    tokenizer = _tokenizer(args.hf_checkpoint)
    max_response_len = sampling_params["max_new_tokens"]
    while (budget := max_response_len - sample.response_length) > 0:
        num_calls = sample.metadata.get("calculator_calls", 0)
        stop = list(sampling_params["stop"]) + ([CALL] if num_calls < MAX_CALLS else [])
        turn_start = sample.metadata.get("turn_start", 0)  # where the model's current turn began in the response
        reply = await router_generate(sample, {"input_ids": list(sample.tokens), "return_logprob": True,
                                               "sampling_params": {**sampling_params, "max_new_tokens": budget,
                                                                   "stop": stop}})
        finish = append_reply(sample, reply)  # the model's tokens: loss_mask 1, their log-probs
        called = finish == "stop" and reply["meta_info"]["finish_reason"].get("matched") == CALL
        if not called:  # end of sequence, the budget, or an abort (the sample keeps what it has)
            return sample
        answer = tokenizer.encode(calculate(sample.response[turn_start:]) + "\n", add_special_tokens=False).ids
        answer = answer[: max_response_len - sample.response_length]
        sample.append_response_tokens(args, tokens=answer, trainable=False, text=tokenizer.decode(answer))
        sample.metadata.update(calculator_calls=num_calls + 1, turn_start=len(sample.response))
    sample.status = sample.Status.TRUNCATED
    return sample


async def reward(args, sample) -> float:
    """1 when the last number of the response (the model's answer, or the calculator's) is the label."""
    numbers = _NUMBER.findall(sample.response)
    return float(bool(numbers) and numbers[-1] == sample.label.strip())
