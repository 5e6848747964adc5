"""A cheap look at `make demo-agent`'s warm model without services: greedily (Hugging Face generate, the demo's chat
template), does it call `solve` on a held-out question, and, given the tool's result, does its answer end with it?
"""

from __future__ import annotations

import json
from pathlib import Path

from examples.agent.solver import TOOL


def check_warm(model_dir: Path, test_path: Path, count: int, max_new_tokens: int = 40) -> tuple[int, int]:
    """(questions on which the model's first turn calls `solve`, questions whose answer after a `solve` turn and its
    result ends with the label), over the first `count` questions of `test_path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.generation.prompts import PromptEncoder

    encoder = PromptEncoder(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def complete(messages: list[dict]) -> str:
        ids = encoder.encode_text(encoder.render_messages(messages, [TOOL], add_generation_prompt=True))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=encoder.eos_token_id, pad_token_id=encoder.eos_token_id)
        return encoder.tokenizer.decode(out[0, len(ids):].tolist()).split("<|im_end|>")[0]

    calls = copies = 0
    rows = [json.loads(line) for line in Path(test_path).read_text().splitlines()[:count]]
    for row in rows:
        asked = [{"role": "user", "content": row["input"]}]
        calls += "<tool_call>" in complete(asked)
        answered = complete([*asked, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "solve", "arguments": {}}}]},
            {"role": "tool", "content": row["label"]}])
        copies += answered.rstrip(" .").endswith(row["label"])
    return calls, copies
