"""CPU engine decode tokens/s against `transformers` `generate` on the same model, batch and lengths, logprobs on.

`python bench/engine_decode.py [--rounds 3]`. The engine runs as a process with one torch thread and gets the batch as
one /generate with 32 input_ids (SGLang's batch form, as the rollout manager sends a group; the headline), and again as
32 concurrent /generate requests, which adds 32 requests' HTTP handling to the same decode (return_logprob,
ignore_eos, temperature 1); `generate` runs in this process, also on one thread, sampling the same number of tokens
and returning each token's log-prob (from output_logits). Rounds
alternate between the sides; the best round of each counts. Models: the demo's (2 layers, hidden 128) and a 4-layer,
256-wide one. Prints a table, then one JSON line (`engine_vs_hf_generate`: the demo model).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, print_table, start_engine  # noqa: E402
from physarum import tasks, tinymodel  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]


def engine_seconds(url: str, batch: int, new_tokens: int, *, batched: bool = False) -> float:
    """Seconds for `batch` sequences: one /generate with a list of `batch` input_ids (SGLang's batch form, what the
    rollout manager sends per group) when `batched`, else `batch` concurrent single requests."""
    import httpx

    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    body = {"input_ids": [PROMPT] * batch if batched else PROMPT, "return_logprob": True, "sampling_params": sampling}
    calls = 1 if batched else batch
    with httpx.Client(timeout=300.0, limits=httpx.Limits(max_connections=calls)) as http, \
            concurrent.futures.ThreadPoolExecutor(calls) as pool:
        start = time.perf_counter()
        replies = list(pool.map(lambda _: http.post(f"{url}/generate", json=body), range(calls)))
        elapsed = time.perf_counter() - start
    outputs = []
    for reply in replies:
        reply.raise_for_status()
        outputs += reply.json() if batched else [reply.json()]
    assert len(outputs) == batch and all(len(out["output_ids"]) == new_tokens for out in outputs)
    return elapsed


def hf_seconds(model, batch: int, new_tokens: int) -> float:
    import torch

    input_ids = torch.tensor([PROMPT] * batch)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
                             top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        tokens = out.sequences[:, len(PROMPT):]
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    elapsed = time.perf_counter() - start
    assert len(logprobs[0]) == new_tokens
    return elapsed


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-engine-"))
    rows, figures = [], {}
    for label, layers, hidden in (("demo (2 x 128)", 2, 128), ("4 x 256", 4, 256)):
        model_dir = tinymodel.build_tiny_model(work / f"model-{layers}x{hidden}", tasks.corpus(), num_layers=layers,
                                               hidden_size=hidden)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        engine, url = start_engine(work, model_dir, f"engine-{layers}x{hidden}",
                                   "--max-batch-size", str(args.batch))
        try:
            engine_seconds(url, args.batch, 4)  # warm-up
            hf_seconds(model, args.batch, 4)
            batched_s, concurrent_s, hf_s = [], [], []
            for _ in range(args.rounds):
                batched_s.append(engine_seconds(url, args.batch, args.new_tokens, batched=True))
                concurrent_s.append(engine_seconds(url, args.batch, args.new_tokens))
                hf_s.append(hf_seconds(model, args.batch, args.new_tokens))
        finally:
            engine.stop()
        num_tokens = args.batch * args.new_tokens
        batched_tps, concurrent_tps, hf_tps = (num_tokens / min(times) for times in (batched_s, concurrent_s, hf_s))
        figures[label] = (batched_tps / hf_tps, concurrent_tps / hf_tps)
        rows.append([label, f"{hf_tps:,.0f}", f"{batched_tps:,.0f}", batched_tps / hf_tps, f"{concurrent_tps:,.0f}",
                     concurrent_tps / hf_tps])
    print_table(f"decode tokens/s, batch {args.batch}, {args.new_tokens} new tokens, logprobs on, 1 thread each "
                f"(best of {args.rounds})",
                ["model", "HF generate tok/s", "engine, one batched /generate, tok/s",
                 "batched / generate (goal >= 1.0)",
                 f"engine, {args.batch} concurrent /generate, tok/s", "concurrent / generate"], rows)
    (demo, demo_concurrent), (wide, wide_concurrent) = figures["demo (2 x 128)"], figures["4 x 256"]
    emit({"engine_vs_hf_generate": demo, "engine_vs_hf_generate_4x256": wide,
          "engine_vs_hf_generate_concurrent": demo_concurrent,
          "engine_vs_hf_generate_4x256_concurrent": wide_concurrent})
    return 0


if __name__ == "__main__":
    sys.exit(main())
