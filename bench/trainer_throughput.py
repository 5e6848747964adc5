"""Physarum's GRPO step (fsdp and megatron backends) against a plain PyTorch loop, then packed against padded
micro-batches on long-tailed responses: one optimizer step each, side by side in one process, rounds interleaved.

1. Equal lengths: the plain loop (an HF model + AdamW, loss -(log π(response)·A).mean(), bf16 autocast under
   --dtype bfloat16) and both backends on the same model, batch, micro-batches and precision; each backend as it
   runs (packing a micro-batch only where that saves tokens: here none) and always padded.
2. Long tail: response lengths max_response_len · u² at u = (i + ½) / n (shuffled), so that the median response is a
   quarter of the longest. The plain loop and each backend padded (micro_batch_size samples, padded to the longest
   of them), each backend packed (use_dynamic_batch_size: one row of at most max_tokens_per_gpu = micro_batch_size
   × the longest sample's tokens, the padded micro-batch's worst case). Tokens/s count real tokens only.

Prints the tables, then one JSON line: {"device", "dtype", "clock", "fsdp": R, "megatron": R,
"equal_vs_padded_fsdp": E, "equal_vs_padded_megatron": E, "packed_vs_padded_fsdp": P, "packed_vs_padded_megatron": P,
"packed_vs_plain_fsdp": Q, "packed_vs_plain_megatron": Q}: R = a backend's tokens/s over the plain loop's (equal
lengths), E = the backend as it runs over the same backend always padded (equal lengths), P = packed over the same
backend padded, Q = packed over the plain loop (long tail). Added to those: "tokens_per_s" and "tail_tokens_per_s"
(each run's), and on CUDA "mfu" and "tail_mfu" (each run's model FLOPs per second over the card's peak, `mfu`),
"peak_tflops" and "peak_source".
CPU: a small Qwen3-shaped model; CUDA: the Qwen3-0.6B shape of the issue's H100 measurement.

3. MoE: a tiny Qwen3-MoE (4 experts, 2 per token) on the equal-length batch, fsdp in this process against megatron with
   its experts over two ranks (EP=2, data-parallel 2: two processes of one thread each; one on a single GPU).
   Adds "moe_megatron_vs_fsdp" (megatron's tokens/s over fsdp's), "moe_expert_parallel_size" and "moe_tokens_per_s"
   to the JSON line; --moe-only runs this phase alone (its keys alone).

4. Compiled (opt-in, --compiled): each backend with compile_layers on (regional torch.compile of the decoder layer,
   one compile shared by every layer) beside the same backend eager, on the equal-length batch, rounds interleaved.
   The first step of each (the warm-up, where dynamo and inductor compile) is left out of the medians; its wall
   seconds, less the eager backend's first step, are the compile time. Adds "compiled_vs_eager_fsdp" and
   "compiled_vs_eager_megatron" (the compiled backend's tokens/s over the same backend eager), "compile_s_fsdp" and
   "compile_s_megatron" (wall seconds), "compiled_graphs" (graphs dynamo compiled in the phase) and
   "compiled_tokens_per_s" (each run's) to the JSON line; --compiled-only runs this phase alone (its keys alone).
   On a shared 2-core CPU machine --compiled-only took 83 s the first time, 44 s once inductor's on-disk cache held its
   kernels (docs/benchmarks.md).

Run: python -m bench.trainer_throughput [--device cpu|cuda] [--dtype float32|bfloat16] [--rounds N]
     [--threads N] [--clock wall|cpu] [--moe-only] [--compiled | --compiled-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

# (model, batch) per device: the Qwen3-0.6B measurement on CUDA, a small model on CPU
SHAPES = {
    "cpu": dict(model=dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64),
                num_samples=16, prompt_len=32, response_len=96, micro_batch_size=4,
                long_tail=dict(num_samples=16, prompt_len=16, max_response_len=256)),
    "cuda": dict(model=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128),
                 num_samples=32, prompt_len=256, response_len=768, micro_batch_size=4,
                 long_tail=dict(num_samples=32, prompt_len=256, max_response_len=1024)),
}


# the MoE phase's model: the shape's, each MLP 4 experts of a quarter of its width, 2 routed per token
MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)


# Dense bf16 / tf32 tensor-core peaks (FLOP/s) by device name; a card not listed gets its peak measured
PEAKS = {"H200": (989e12, 494e12), "H100": (989e12, 494e12), "A100": (312e12, 156e12), "L40S": (362e12, 183e12),
         "A10G": (70e12, 35e12), "L4": (121e12, 60e12)}


def layer_parameters(model: dict) -> tuple[int, int, int]:
    """Parameters a token multiplies: one layer's attention projections (q, o; k, v), one layer's MLP, the LM head."""
    hidden = model["hidden_size"]
    attention = hidden * model["head_dim"] * (2 * model["num_attention_heads"] + 2 * model["num_key_value_heads"])
    return attention, 3 * hidden * model["intermediate_size"], model["vocab_size"] * hidden


def flops_per_token(model: dict, seq_len: float) -> float:
    """Training FLOPs per token: 6 × the parameters each token multiplies (the layers' projections and MLP, the LM
    head; not the embedding lookup) plus causal attention's scores and weighted sum, 6 × layers × heads × head_dim ×
    seq_len (half of the full square's 12)."""
    layers = model["num_hidden_layers"]
    attention, mlp, head = layer_parameters(model)
    matmul_params = layers * (attention + mlp) + head
    return 6 * matmul_params + 6 * layers * model["num_attention_heads"] * model["head_dim"] * seq_len


def matrix_flops(model: dict, row_slots: int, loss_rows: int) -> float:
    """Training FLOPs (6 per multiply-add: forward and backward) of the parameters' products in one step over
    `row_slots` row positions (tokens and padding) of which `loss_rows` predict a response token: every layer's
    projections and all but the last layer's MLP on every slot; the last layer's MLP and the LM head on the loss rows
    alone, as both backends run them under the fused head (`backends/last_layer_rows.py`). Attention's scores are
    left out."""
    layers = model["num_hidden_layers"]
    attention, mlp, head = layer_parameters(model)
    return 6 * (row_slots * (layers * attention + (layers - 1) * mlp) + loss_rows * (mlp + head))


def tail_padded_slots(lengths: list[int], micro_batch_size: int) -> dict[str, int]:
    """Row positions a long-tail step pads to on each backend: each micro-batch's samples × its longest, in the
    micro-batches the backend's own schedule cuts (fsdp: `step_schedule`; megatron: `dp_schedule`, one rank)."""
    from services.trainer.batching.schedule import dp_schedule, step_schedule

    (fsdp,) = step_schedule(lengths, global_batch_size=len(lengths), micro_batch_size=micro_batch_size)
    (megatron,) = dp_schedule(lengths, range(len(lengths)), dp_size=1, micro_batch_size=micro_batch_size)
    return {name: sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches)
            for name, micro_batches in (("fsdp", fsdp), ("megatron", megatron))}


def card_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The card's dense matrix peak in `dtype` (tf32 for float32): from PEAKS by name, else a measured 8192³
    matmul."""
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in PEAKS.items():
        if key in name:
            return (half if dtype != torch.float32 else tf32), f"{name} (table)"
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    for _ in range(2):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    return 5 * 2 * 8192**3 / (time.perf_counter() - start), f"{name} (measured matmul)"


def build_model(out_dir: Path, shape: dict) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                         dtype="float32")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def build_moe_model(out_dir: Path, shape: dict) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**shape, **MOE_FIELDS, moe_intermediate_size=shape["intermediate_size"] // 4,
                            max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1e6, dtype="float32")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def make_samples(shape: dict, vocab_size: int):
    from services.common.samples import Sample

    gen = torch.Generator().manual_seed(0)
    length = shape["prompt_len"] + shape["response_len"]
    return [Sample(tokens=torch.randint(1, vocab_size, (length,), generator=gen).tolist(),
                   response_length=shape["response_len"], reward=float(i % 2)) for i in range(shape["num_samples"])]


def long_tailed_samples(shape: dict, vocab_size: int):
    """Response lengths max · u² at u = (i + ½) / n, shuffled: a median of a quarter of the max, a few near it."""
    from services.common.samples import Sample

    tail = shape["long_tail"]
    num, longest = tail["num_samples"], tail["max_response_len"]
    gen = torch.Generator().manual_seed(0)
    lengths = [max(1, round(longest * ((i + 0.5) / num) ** 2)) for i in range(num)]
    lengths = [lengths[i] for i in torch.randperm(num, generator=gen).tolist()]
    return [Sample(tokens=torch.randint(1, vocab_size, (tail["prompt_len"] + n,), generator=gen).tolist(),
                   response_length=n, reward=float(i % 2)) for i, n in enumerate(lengths)]


def packed_budget(shape: dict) -> int:
    """Tokens a packed long-tail micro-batch holds at most: micro_batch_size samples of the longest length, the
    padded micro-batch's largest size (both layouts fit the same memory)."""
    tail = shape["long_tail"]
    return shape["micro_batch_size"] * (tail["prompt_len"] + tail["max_response_len"])


def plain_step(model_dir: Path, samples, prompt_len: int, micro_batch_size: int, device: torch.device,
               dtype: torch.dtype) -> Callable[[], None]:
    """An HF model + AdamW over padded micro-batches (each padded to its longest sample): -(log π·A) averaged over
    the response tokens, backward, clip, step. Every sample's prompt is prompt_len tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    micro_batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start:start + micro_batch_size]
        longest = max(len(s.tokens) for s in chunk)
        ids = torch.tensor([s.tokens + [0] * (longest - len(s.tokens)) for s in chunk], device=device)
        mask = torch.tensor([[1] * len(s.tokens) + [0] * (longest - len(s.tokens)) for s in chunk], device=device)
        advantages = torch.tensor([s.reward - 0.5 for s in chunk], device=device)
        micro_batches.append((ids, mask, mask[:, prompt_len:].float() * advantages[:, None]))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for ids, mask, weights in micro_batches:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            log_probs = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
            log_probs = log_probs.gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)
            loss = -(log_probs * weights).sum() / mask[:, prompt_len:].sum() / len(micro_batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def train_config(shape: dict, dtype: torch.dtype, num_samples: int, packed_budget: int | None = None,
                 compiled: bool = False):
    """micro_batch_size samples per micro-batch; with packed_budget, micro-batches packed to that many tokens;
    compiled: compile_layers on."""
    from services.trainer.settings.train import TrainConfig

    return TrainConfig(n_samples_per_prompt=2, global_batch_size=num_samples,
                       micro_batch_size=shape["micro_batch_size"], lr=1e-6, bf16=dtype == torch.bfloat16,
                       use_dynamic_batch_size=packed_budget is not None, max_tokens_per_gpu=packed_budget,
                       compile_layers=compiled)


def fsdp_step(model_dir: Path, samples, config, device: torch.device, packed: bool = True) -> Callable[[], None]:
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.distributed.parallel import World

    backend = TorchBackend(model_dir, config, world=World(device=device), pack_sequences=packed)
    return lambda: backend.train_rollout(samples)


def megatron_step(model_dir: Path, samples, config, device: torch.device, packed: bool = True) -> Callable[[], None]:
    from services.trainer.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend(model_dir, config, pack_sequences=packed)
    return lambda: backend.train_rollout(samples)


def expert_parallel_rank(rank: int, world_size: int, model_dir: Path, shape: dict, dtype_name: str, rounds: int,
                         clock_name: str, out: Path) -> None:
    """One rank of megatron at EP=world_size: median seconds per step over `rounds` after a warm-up, each step
    between barriers (wall clock), or the ranks' CPU time summed (cpu clock); rank 0 writes it to `out`."""
    import torch.distributed as dist

    from services.trainer.backends.megatron.backend import MegatronBackend

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    samples = make_samples(shape, shape["model"]["vocab_size"])
    # the ranks' group from spawn's torchrun-style environment
    backend = MegatronBackend(model_dir, train_config(shape, getattr(torch, dtype_name), len(samples)),
                              expert_model_parallel_size=world_size)
    device = backend.device
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    seconds = []
    for round_index in range(rounds + 1):
        dist.barrier()
        took = timed(lambda: backend.train_rollout(samples), device, clock)
        if clock_name == "cpu":
            total = torch.tensor([took], dtype=torch.float64)
            dist.all_reduce(total)
            took = float(total)
        dist.barrier()
        if round_index:
            seconds.append(took)
    backend.close()
    if rank == 0:
        out.write_text(json.dumps(statistics.median(seconds)))


def moe_phase(tmp: Path, shape: dict, device: torch.device, dtype: torch.dtype, rounds: int,
              clock_name: str) -> dict:
    """fsdp here against megatron at EP=2 in two spawned processes (EP=1 in one on a single GPU): tokens/s each."""
    from bench.megatron_parity import spawn

    model_dir = build_moe_model(tmp / "moe-model", shape["model"])
    samples = make_samples(shape, shape["model"]["vocab_size"])
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    fsdp = measure({"fsdp": fsdp_step(model_dir, samples, train_config(shape, dtype, len(samples)), device)}, rounds,
                   device, clock)["fsdp"]
    release(device)
    ranks = 2 if device.type == "cpu" else min(2, torch.cuda.device_count())
    out = tmp / "moe-megatron.json"
    spawn(expert_parallel_rank, model_dir, shape, str(dtype).removeprefix("torch."), rounds, clock_name, out,
          world_size=ranks)
    num_tokens = len(samples) * (shape["prompt_len"] + shape["response_len"])
    return {"expert_parallel_size": ranks, "fsdp": num_tokens / fsdp,
            "megatron": num_tokens / json.loads(out.read_text())}


def timed(step: Callable[[], None], device: torch.device, clock: Callable[[], float]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def measure(steps: dict[str, Callable[[], None]], rounds: int, device: torch.device,
            clock: Callable[[], float], warm_up_s: dict[str, float] | None = None) -> dict[str, float]:
    """Median seconds per step of each run, rounds interleaved after one warm-up round; given warm_up_s, each run's
    warm-up step in wall seconds goes there (compiling runs compile in it, partly in inductor's own processes)."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(rounds + 1):  # round 0 warms up (allocator, kernels, optimizer state, compiles)
        for name, step in steps.items():
            if round_index == 0 and warm_up_s is not None:
                warm_up_s[name] = timed(step, device, time.perf_counter)
                continue
            took = timed(step, device, clock)
            if round_index:
                seconds[name].append(took)
    return {name: statistics.median(values) for name, values in seconds.items()}


def compiled_phase(model_dir: Path, shape: dict, device: torch.device, dtype: torch.dtype, rounds: int,
                   clock: Callable[[], float]) -> dict:
    """Each backend eager and with compile_layers on, the equal-length batch, rounds interleaved: median seconds
    per step, the warm-up steps' wall seconds, and the graphs dynamo compiled."""
    from services.trainer.backends import compiled_layers

    samples = make_samples(shape, shape["model"]["vocab_size"])
    graphs_before = compiled_layers.compiles_so_far()
    steps = {f"{name}{suffix}": build(model_dir, samples, train_config(shape, dtype, len(samples), compiled=compiled),
                                      device)
             for name, build in (("fsdp", fsdp_step), ("megatron", megatron_step))
             for suffix, compiled in (("", False), (" compiled", True))}
    warm_up_s: dict[str, float] = {}
    seconds = measure(steps, rounds, device, clock, warm_up_s)
    del steps
    release(device)
    return {"num_tokens": len(samples) * (shape["prompt_len"] + shape["response_len"]), "seconds": seconds,
            "warm_up_s": warm_up_s, "graphs": compiled_layers.compiles_so_far() - graphs_before}


def compiled_result(compiled: dict) -> dict:
    """The compiled phase's table printed and its JSON keys: compiled over eager tokens/s per backend, and the
    compile time (the compiled warm-up step's wall seconds less the eager one's)."""
    num_tokens, seconds, warm_up_s = compiled["num_tokens"], compiled["seconds"], compiled["warm_up_s"]
    print(f"compiled layers (equal lengths, {num_tokens} tokens per step; {compiled['graphs']} graphs compiled)")
    print(f"{'run':<18} {'s/step':>8} {'tokens/s':>10} {'vs eager':>9} {'first step s':>13}")
    result: dict = {}
    for name in ("fsdp", "megatron"):
        ratio = seconds[name] / seconds[f"{name} compiled"]
        result[f"compiled_vs_eager_{name}"] = round(ratio, 3)
        result[f"compile_s_{name}"] = round(max(0.0, warm_up_s[f"{name} compiled"] - warm_up_s[name]), 1)
        for run, vs_eager in ((name, 1.0), (f"{name} compiled", ratio)):
            print(f"{run:<18} {seconds[run]:>8.3f} {num_tokens / seconds[run]:>10.0f} {vs_eager:>9.2f} "
                  f"{warm_up_s[run]:>13.1f}")
    result["compiled_graphs"] = compiled["graphs"]
    result["compiled_tokens_per_s"] = {run: round(num_tokens / value, 1) for run, value in seconds.items()}
    return result


def bench_device(name: str, threads: int) -> torch.device:
    """The device a trainer bench runs on, made current: the first GPU ("cuda"), or the CPU; `threads` torch threads
    (for the host's work on a GPU too)."""
    torch.set_num_threads(threads)
    if name != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def trainer_dtype(device: torch.device) -> torch.dtype:
    """The trainer's default precision on `device`: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def release(device: torch.device) -> None:
    """Free the finished phase's models (Megatron's groups go with the next backend it builds)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu (the trainer's defaults)")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (user + system), for a CPU run on a busy shared machine, "
                             "where waiting for a core inflates wall time at random (use --threads 1: no spinning)")
    parser.add_argument("--moe-only", action="store_true", help="run the MoE phase alone")
    compiled_flags = parser.add_mutually_exclusive_group()
    compiled_flags.add_argument("--compiled", action="store_true",
                                help="add the compiled phase: each backend with compile_layers on against eager")
    compiled_flags.add_argument("--compiled-only", action="store_true", help="run the compiled phase alone")
    args = parser.parse_args(argv)
    if args.moe_only and (args.compiled or args.compiled_only):
        parser.error("--moe-only runs the MoE phase alone: drop --compiled/--compiled-only")
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU runs only")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    device = bench_device(args.device, args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else trainer_dtype(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the trainer's default (allow_tf32), for a like comparison
    shape = SHAPES[device.type]
    tail = shape["long_tail"]
    if args.moe_only:
        with tempfile.TemporaryDirectory() as tmp:
            moe = moe_phase(Path(tmp), shape, device, dtype, args.rounds, args.clock)
        result = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "clock": args.clock,
                  **moe_result(moe)}
        print(json.dumps(result))
        return result
    if args.compiled_only:
        with tempfile.TemporaryDirectory() as tmp:
            compiled = compiled_phase(build_model(Path(tmp) / "model", shape["model"]), shape, device, dtype,
                                      args.rounds, clock)
        result = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "clock": args.clock,
                  **compiled_result(compiled)}
        print(json.dumps(result))
        return result
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", shape["model"])
        samples = make_samples(shape, shape["model"]["vocab_size"])
        config = train_config(shape, dtype, len(samples))
        steps = {"plain": plain_step(model_dir, samples, shape["prompt_len"], shape["micro_batch_size"], device, dtype),
                 "fsdp": fsdp_step(model_dir, samples, config, device),
                 "megatron": megatron_step(model_dir, samples, config, device),
                 "fsdp padded": fsdp_step(model_dir, samples, config, device, packed=False),
                 "megatron padded": megatron_step(model_dir, samples, config, device, packed=False)}
        seconds = measure(steps, args.rounds, device, clock)
        del steps
        release(device)
        tailed = long_tailed_samples(shape, shape["model"]["vocab_size"])
        budget = packed_budget(shape)
        padded, packed = (train_config(shape, dtype, len(tailed), b) for b in (None, budget))
        steps = {"plain padded": plain_step(model_dir, tailed, tail["prompt_len"], shape["micro_batch_size"], device,
                                            dtype)}
        steps.update({f"{name} {layout}": build(model_dir, tailed, cfg, device, packed=layout == "packed")
                      for name, build in (("fsdp", fsdp_step), ("megatron", megatron_step))
                      for layout, cfg in (("padded", padded), ("packed", packed))})
        tail_seconds = measure(steps, args.rounds, device, clock)
        del steps
        release(device)
        moe = moe_phase(Path(tmp), shape, device, dtype, args.rounds, args.clock)
        compiled = compiled_phase(model_dir, shape, device, dtype, args.rounds, clock) if args.compiled else None
    num_tokens = len(samples) * (shape["prompt_len"] + shape["response_len"])
    tokens_per_s = {name: num_tokens / value for name, value in seconds.items()}
    print(f"{device.type}, {dtype}, {args.threads if device.type == 'cpu' else 'GPU'} threads, median of "
          f"{args.rounds} rounds, {args.clock} clock")
    print(f"equal lengths: {len(samples)} × {shape['prompt_len'] + shape['response_len']} tokens per step, "
          f"micro-batches of {shape['micro_batch_size']}")
    print(f"{'run':<16} {'s/step':>8} {'tokens/s':>10} {'vs plain':>9}")
    for name, rate in tokens_per_s.items():
        print(f"{name:<16} {num_tokens / rate:>8.3f} {rate:>10.0f} {rate / tokens_per_s['plain']:>9.2f}")
    tail_tokens = sum(len(s.tokens) for s in tailed)
    responses = sorted(s.response_length for s in tailed)
    print(f"long tail: {len(tailed)} samples, {tail_tokens} tokens, prompts of {tail['prompt_len']}, responses "
          f"median {statistics.median(responses):.0f} max {responses[-1]}; padded: micro-batches of "
          f"{shape['micro_batch_size']}, packed: at most {budget} tokens")
    loss_rows = sum(s.response_length for s in tailed)
    packed_flops = matrix_flops(shape["model"], tail_tokens, loss_rows)
    padded_flops = {name: matrix_flops(shape["model"], slots, loss_rows) for name, slots in
                    tail_padded_slots([len(s.tokens) for s in tailed], shape["micro_batch_size"]).items()}
    # the parameters' products are most of a step: their padded/packed ratio is about where packed/padded can reach
    print(f"matrix work a step (projections, MLPs, LM head): packed {packed_flops / 1e9:.1f} GFLOP, padded "
          + ", ".join(f"{name} {flops / 1e9:.1f} GFLOP ({flops / packed_flops:.2f}×)"
                      for name, flops in padded_flops.items()))
    tail_rate = {name: tail_tokens / value for name, value in tail_seconds.items()}
    print(f"{'run':<16} {'s/step':>8} {'tokens/s':>10} {'vs padded':>9} {'vs plain':>9}")
    for name, rate in tail_rate.items():
        padded_rate = tail_rate[name.split()[0] + " padded"]
        print(f"{name:<16} {tail_tokens / rate:>8.3f} {rate:>10.0f} {rate / padded_rate:>9.2f} "
              f"{rate / tail_rate['plain padded']:>9.2f}")
    extra: dict = {"tokens_per_s": {name: round(rate, 1) for name, rate in tokens_per_s.items()},
                   "tail_tokens_per_s": {name: round(rate, 1) for name, rate in tail_rate.items()}}
    if device.type == "cuda":
        peak, source = card_peak(device, dtype)
        equal_flops = flops_per_token(shape["model"], shape["prompt_len"] + shape["response_len"])
        tail_flops = sum(flops_per_token(shape["model"], len(s.tokens)) * len(s.tokens) for s in tailed) / tail_tokens
        extra.update(peak_tflops=round(peak / 1e12, 1), peak_source=source,
                     mfu={name: round(rate * equal_flops / peak, 4) for name, rate in tokens_per_s.items()},
                     tail_mfu={name: round(rate * tail_flops / peak, 4) for name, rate in tail_rate.items()})
        print(f"MFU against {peak / 1e12:.0f} TFLOP/s ({source}): "
              + ", ".join(f"{name} {value:.1%}" for name, value in extra["mfu"].items()))
    result = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "clock": args.clock,
              "fsdp": round(tokens_per_s["fsdp"] / tokens_per_s["plain"], 3),
              "megatron": round(tokens_per_s["megatron"] / tokens_per_s["plain"], 3),
              **{f"equal_vs_padded_{name}": round(tokens_per_s[name] / tokens_per_s[f"{name} padded"], 3)
                 for name in ("fsdp", "megatron")},
              **{f"packed_vs_padded_{name}": round(tail_rate[f"{name} packed"] / tail_rate[f"{name} padded"], 3)
                 for name in ("fsdp", "megatron")},
              **{f"packed_vs_plain_{name}": round(tail_rate[f"{name} packed"] / tail_rate["plain padded"], 3)
                 for name in ("fsdp", "megatron")}, **extra, **moe_result(moe)}
    if compiled is not None:
        result.update(compiled_result(compiled))
    print(json.dumps(result))
    return result


def moe_result(moe: dict) -> dict:
    """The MoE phase's table printed and its JSON keys."""
    ep = moe["expert_parallel_size"]
    print(f"MoE (Qwen3-MoE, {MOE_FIELDS['num_experts']} experts, {MOE_FIELDS['num_experts_per_tok']} per token): "
          f"fsdp {moe['fsdp']:.0f} tokens/s, megatron EP={ep} {moe['megatron']:.0f} tokens/s, "
          f"ratio {moe['megatron'] / moe['fsdp']:.2f}")
    return {"moe_megatron_vs_fsdp": round(moe["megatron"] / moe["fsdp"], 3), "moe_expert_parallel_size": ep,
            "moe_tokens_per_s": {"fsdp": round(moe["fsdp"], 1), f"megatron ep{ep}": round(moe["megatron"], 1)}}


if __name__ == "__main__":
    main()
