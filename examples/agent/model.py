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
                      transcripts: list[list[tuple[str, bool]]] | None = None, warmup_steps: int = 300,
                      drills: list[dict[str, Any]] | None = None,
                      batch_sizes: tuple[int | None, int | None] = (None, None), max_lr: float = 1e-2) -> Path:
    """Tokenizer (with TOOLS_CHAT_TEMPLATE) and model in one HF directory; with `conversations` ({"messages",
    "tools"}), trained on their assistant turns until it reproduces them greedily; with `transcripts` (plain text as
    (piece, trained) pairs, each ending at end-of-sequence), on their trained pieces; with `drills` (conversations
    with a tool turn), on their last answer after their last tool turn, from that turn on (copy exercises, a fifth
    of a conversation's tokens). `batch_sizes`: rows of each kind (conversations and transcripts, drills) per step
(None: all). Skips work already done."""
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
    if conversations or transcripts or drills:
        rows = _chat_rows(out_dir, conversations or []) + _text_rows(out_dir, transcripts or [])
        _warm_up(model, rows, warmup_steps, drills=_drill_rows(out_dir, drills or []), batch_sizes=batch_sizes,
                 max_lr=max_lr)
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


def _drill_rows(out_dir: Path, drills: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """Each drill's row from the newline before its last tool turn on: the tool's result, then the answer trained
    (the tokens a session has there; the system prompt and question before them are left out)."""
    from services.rollout.generation.prompts import PromptEncoder

    start = PromptEncoder(out_dir).encode_text("\n<|im_start|>user\n<tool_response>")
    rows = []
    for ids, mask in _chat_rows(out_dir, drills):
        cut = max(i for i in range(len(ids) - len(start) + 1) if ids[i:i + len(start)] == start)
        rows.append((ids[cut:], mask[cut:]))
    return rows


def _warm_up(model: Any, rows: list[tuple[list[int], list[int]]], steps: int, *,
             drills: list[tuple[list[int], list[int]]] | None = None,
             batch_sizes: tuple[int | None, int | None] = (None, None), max_lr: float = 1e-2) -> float:
    """Next-token loss on the rows' trained tokens (plus the drills', each kind's mean), Adam, until the loss is
    near 0 (at most `steps` steps); returns the last loss. `batch_sizes`: rows of each kind per step, drawn at
    random (None: all of them). The learning rate rises to `max_lr` over the first tenth of `steps` and anneals to
    0: at a constant 1e-2 the loss oscillates near 0.1 and the agent's call copies the question's numbers wrongly
    (a JSON call ~70 tokens after the question is a longer copy than the custom-generate format's)."""
    import torch

    def padded(kind: list[tuple[list[int], list[int]]]) -> tuple[Any, Any]:
        width = max(len(ids) for ids, _ in kind)
        return (torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in kind]),
                torch.tensor([m + [0] * (width - len(m)) for _, m in kind], dtype=torch.float32))

    kinds = [(*padded(kind), size) for kind, size in zip((rows, drills or []), batch_sizes, strict=True) if kind]
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=max_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=max(steps, 1),
                                                   pct_start=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is several times faster on a busy machine
    model.train()
    for _ in range(steps):
        loss = torch.zeros(())
        for all_ids, all_weights, batch_size in kinds:
            pick = (slice(None) if batch_size is None or batch_size >= len(all_ids)
                    else torch.randperm(len(all_ids), generator=generator)[:batch_size])
            input_ids, weights = all_ids[pick], all_weights[pick]
            logits = model(input_ids=input_ids).logits[:, :-1]
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
            loss = loss + (losses * weights[:, 1:]).sum() / weights[:, 1:].sum()
        if loss.item() < 0.01:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    torch.set_num_threads(threads)
    return loss.item()
