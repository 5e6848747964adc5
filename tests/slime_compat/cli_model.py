"""A tiny model for the agent CLIs' requests: a byte-level BPE tokenizer (any text, several characters a token, so
Claude Code's first request of ~80k characters fits) trained on the repository's own docs and code, the agent model's
tool chat template, and a Qwen3 with 32k positions (cheap on CPU at 2 layers of width 64) whose weights script an
agent's two turns under greedy decoding: first TOOL_CALLS (a shell command for each CLI's shell tool, one token),
then, after the tool's result, REPLY and the end of its turn.

The weights make a bigram model: attention and MLPs write nothing, so the last hidden state is the last token's
embedding, and each scripted token's output row points at its predecessor's. The template tells the two turns apart
by their last token: its generation prompt after a tool result ends in a blank line ("\\n\\n", one token) instead of
"\\n"."""

from __future__ import annotations

import json
from pathlib import Path

from examples.agent.model import TOOLS_CHAT_TEMPLATE
from physarum import tinymodel

ROOT = Path(__file__).resolve().parents[2]
REPLY = "Done."
COMMAND = "echo $((6*7))"
COMMAND_OUTPUT = "42"
# Claude Code's shell tool and Codex's; each CLI runs the one it declares (the other stays in the text)
TOOL_CALLS = "".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': {key: COMMAND}})}\n</tool_call>"
                     for name, key in (("Bash", "command"), ("exec_command", "cmd")))
_GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
assert TOOLS_CHAT_TEMPLATE.endswith(_GENERATION_PROMPT)
CLI_CHAT_TEMPLATE = TOOLS_CHAT_TEMPLATE.removesuffix(_GENERATION_PROMPT) + (
    "{%- set turn = namespace(after_tool=false) -%}"
    "{%- for message in messages -%}{%- if message.role == 'assistant' -%}{%- set turn.after_tool = false -%}"
    "{%- elif message.role == 'tool' -%}{%- set turn.after_tool = true -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if turn.after_tool -%}{{- '\n' -}}{%- endif -%}{%- endif -%}")


def corpus() -> list[str]:
    files = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "services").rglob("*.py"))
    return [path.read_text(errors="replace") for path in files]


def build_cli_model(out_dir: Path, *, max_positions: int = 32768, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Tokenizer and model in one HF directory; skips the work when it is already there."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=tinymodel.SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(TOOL_CALLS, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=tinymodel.EOS_TOKEN,
                                   pad_token=tinymodel.EOS_TOKEN, unk_token="<unk>",
                                   model_max_length=max_positions)
    fast.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(CLI_CHAT_TEMPLATE)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2))
    eos_id = tokenizer.token_to_id(tinymodel.EOS_TOKEN)
    config = Qwen3Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=eos_id,
                         eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    end = tokenizer.token_to_id("<|im_end|>")
    header, blank = (tokenizer.encode(f"<|im_start|>assistant\n{extra}").ids[-1] for extra in ("", "\n"))
    chains = [[header, tokenizer.token_to_id(TOOL_CALLS), end], [blank, *tokenizer.encode(REPLY).ids, end]]
    pairs = {(before, after) for chain in chains for before, after in zip(chain[:-1], chain[1:], strict=True)}
    assert len({before for before, _ in pairs}) == len(pairs), f"a token of {chains} has two successors"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        model.lm_head.weight.zero_()
        for before, after in pairs:  # a token that ends both turns sums both predecessors' directions
            model.lm_head.weight[after] += 50.0 * embeddings[before] / embeddings[before].norm()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
