"""Memory of the causal mask transformers would build for one packed row, built against skipped, side by side.

A packed row has no attention mask, only positions that restart at each sequence; from them transformers builds a
[T, T] block-diagonal causal mask (one byte a pair of positions, and temporaries of that size while it builds it) at
every forward. The fsdp backend runs a packed row's forwards under `varlen.packed_row`, where that mask is not built:
`varlen.hf_attention` keeps the sequences apart by their cumulative lengths and would not read it. Each size is a row
of T tokens in eight sequences, the mask made through transformers' own `create_causal_mask` for a model switched to
that attention, outside `packed_row` (built) and inside it (skipped).

CPU: the process's peak resident set over its resident set before (bench/trainer_memory.py's `peak_bytes`); CUDA:
torch's peak allocated bytes.

Prints a table, then one JSON line: {"device", "peak_mib": {"built_8k": M, "skipped_8k": M, ...}, "held_mib":
{"built_8k": M, ...}} — peak: the most memory held while making the mask; held: the mask itself, what a forward keeps
until it ends.

Run: python -m bench.packed_row_mask [--device cpu|cuda] [--sizes 8192,16384,32768]
"""

from __future__ import annotations

import argparse
import functools
import json
import types

import torch

SEQUENCES = 8  # the row's sequences, of equal length


def mask_model() -> types.SimpleNamespace:
    """The least a model needs for transformers' mask functions: a text config, switched to varlen's attention."""
    from transformers import Qwen3Config

    from services.trainer.batching import varlen

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=256)
    model = types.SimpleNamespace(config=config)
    model.set_attn_implementation = lambda name: setattr(config, "_attn_implementation", name)
    varlen.use_in(model)
    assert varlen.active(model)
    return model


def make_mask(config, tokens: int, device: torch.device) -> torch.Tensor | None:
    """transformers' causal mask for one row of `tokens` positions in SEQUENCES sequences."""
    from transformers.masking_utils import create_causal_mask

    lengths = [tokens // SEQUENCES] * (SEQUENCES - 1) + [tokens - tokens // SEQUENCES * (SEQUENCES - 1)]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
    embeds = torch.zeros(1, tokens, 1, device=device)  # only its shape, dtype and device are read
    return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=positions)


def measure(tokens: int, device: torch.device) -> dict[str, tuple[int, int]]:
    """{"built" | "skipped": (peak bytes while making the mask, bytes of the mask made)}."""
    from bench.trainer_memory import peak_bytes
    from services.trainer.batching import varlen

    config = mask_model().config
    made: list[torch.Tensor | None] = []

    def make(packed: bool) -> None:
        with varlen.packed_row(packed):
            made.append(make_mask(config, tokens, device))

    out = {}
    for name, packed in (("built", False), ("skipped", True)):
        peak = peak_bytes(functools.partial(make, packed), device.type)
        mask = made.pop()
        out[name] = (peak, 0 if mask is None else mask.numel() * mask.element_size())
        del mask
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="8192,16384,32768", help=f"tokens per row, each at least {SEQUENCES}")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(n < SEQUENCES for n in sizes):
        parser.error(f"--sizes: each at least {SEQUENCES} tokens")
    device = torch.device(args.device)
    peak_mib, held_mib = {}, {}
    print(f"{device.type}: transformers' causal mask for one packed row of {SEQUENCES} sequences")
    print(f"{'tokens':>8} {'built: peak MiB':>16} {'held MiB':>9} {'skipped: peak MiB':>18} {'held MiB':>9}")
    for tokens in sizes:
        runs = measure(tokens, device)
        key = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
        for name, (peak, held) in runs.items():
            peak_mib[f"{name}_{key}"] = round(peak / 2**20, 1)
            held_mib[f"{name}_{key}"] = round(held / 2**20, 1)
        print(f"{tokens:>8} {peak_mib[f'built_{key}']:>16.1f} {held_mib[f'built_{key}']:>9.1f} "
              f"{peak_mib[f'skipped_{key}']:>18.1f} {held_mib[f'skipped_{key}']:>9.1f}")
    result = {"device": device.type, "peak_mib": peak_mib, "held_mib": held_mib}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
