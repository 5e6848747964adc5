"""A tiny model for agents: the demo's character tokenizer and Qwen3 architecture with a Qwen/Hermes chat template
that renders tools and tool calls, a context long enough for a few tool turns, and an optional warm-up that teaches
it given conversations (so a random model emits real <tool_call> blocks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from physarum import tasks, tinymodel

# Qwen2.5's tool format: the tools in the system turn, calls as <tool_call> JSON, results as <tool_response>.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n<tools>\n' -}}{%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}"
    "{{- '</tools><|im_end|>\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\n' + (message.content or '') -}}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{{- '<tool_call>\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
EXTRA_CHARACTERS = "{}[]\"'_<>|#;&%$@^`~\\"


def corpus() -> list[str]:
    return [*tasks.corpus(), EXTRA_CHARACTERS]


def build_agent_model(out_dir: Path, *, max_positions: int = 2048, hidden_size: int = 64, num_layers: int = 2,
                      seed: int = 0, conversations: list[dict[str, Any]] | None = None,
                      transcripts: list[list[tuple[str, bool]]] | None = None, warmup_steps: int = 300) -> Path:
    """Tokenizer (with TOOLS_CHAT_TEMPLATE) and model in one HF directory; with `conversations` ({"messages",
    "tools"}), trained on their assistant turns until it reproduces them greedily; with `transcripts` (plain text as
    (piece, trained) pairs, each ending at end-of-sequence), on their trained pieces. Skips work already done."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tinymodel.build_tokenizer(corpus(), out_dir)
    (out_dir / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2))
    model = _new_model(out_dir, max_positions, hidden_size, num_layers, seed)
    if conversations or transcripts:
        rows = _chat_rows(out_dir, conversations or []) + _text_rows(out_dir, transcripts or [])
        _warm_up(model, rows, warmup_steps)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _new_model(out_dir: Path, max_positions: int, hidden_size: int, num_layers: int, seed: int) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    eos_id = vocab[tinymodel.EOS_TOKEN]
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden_size // 4, max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def _chat_rows(out_dir: Path, conversations: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per conversation: its assistant turns (the text after each '<|im_start|>assistant\\n'
    up to and including its <|im_end|>) trained, the rest not."""
    from services.rollout.generation.prompts import PromptEncoder

    encoder = PromptEncoder(out_dir)
    rows = []
    for conversation in conversations:
        messages, tools = conversation["messages"], conversation.get("tools")
        ids, mask, done = [], [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = encoder.render_messages(messages[:i], tools, add_generation_prompt=True)
            # as the gateway does: after the model's turn (ending at <|im_end|>), the newline and the new messages
            new = encoder.encode_text(before if not done else "\n" + before[len(done):])
            done = encoder.render_messages(messages[:i + 1], tools, add_generation_prompt=False)
            turn = encoder.encode_text(done[len(before):].removesuffix("\n"))
            ids, mask = ids + new + turn, mask + [0] * len(new) + [1] * len(turn)
        rows.append((ids, mask))
    return rows


def _text_rows(out_dir: Path, transcripts: list[list[tuple[str, bool]]]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per plain-text transcript, each piece tokenized on its own (as a custom generate
    function appends a tool's answer), the end-of-sequence token appended and trained."""
    from services.rollout.generation.prompts import PromptEncoder

    encoder = PromptEncoder(out_dir)
    rows = []
    for pieces in transcripts:
        ids, mask = [], []
        for text, trained in pieces:
            piece = encoder.encode_text(text)
            ids, mask = ids + piece, mask + [int(trained)] * len(piece)
        rows.append((ids + [encoder.eos_token_id], mask + [1]))
    return rows


def _warm_up(model: Any, rows: list[tuple[list[int], list[int]]], steps: int) -> float:
    """Next-token loss on the rows' trained tokens, full batch, Adam, until the loss is near 0 (at most `steps`
    steps); returns the last loss. The learning rate rises to 1e-2 over the first tenth of `steps` and anneals
    to 0: at a constant 1e-2 the loss oscillates near 0.1 and the agent's call copies the question's numbers wrongly
    (a JSON call ~70 tokens after the question is a longer copy than the custom-generate format's)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    weights = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=max(steps, 1), pct_start=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is several times faster on a busy machine
    model.train()
    for _ in range(steps):
        logits = model(input_ids=input_ids).logits[:, :-1]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
        loss = (losses * weights[:, 1:]).sum() / weights[:, 1:].sum()
        if loss.item() < 0.01:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    torch.set_num_threads(threads)
    return loss.item()
