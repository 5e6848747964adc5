"""HF vs Megatron parity on a tiny Qwen3 (fp32, CPU, gloo, 2 processes): logits and log-probs at TP=1 (DP=2), TP=2
and PP=2, with untied and tied embeddings, and the HF -> Megatron -> HF weight round trip.

Run: .venv/bin/python bench/megatron_parity.py [--json PATH]
Prints a table, then one last line: max_abs_logit_diff=<x> max_abs_logprob_diff=<y> hf_roundtrip_exact=<true|false>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp) on a world of 2: TP=1 runs as DP=2
SEED = 1234


def build_tiny_qwen3(out_dir: Path, *, tie_word_embeddings: bool, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Qwen3 (2 layers unless told) whose vocab (300) needs padding, head_dim != hidden/heads, and non-unit
    norms."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                         tie_word_embeddings=tie_word_embeddings, rope_theta=1e4, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir


def spawn(fn: Callable, *args, world_size: int = 2, start_method: str = "spawn") -> None:
    """Run fn(rank, world_size, *args) in world_size processes joined by torchrun-style env (gloo). "fork" lets
    the children inherit the parent's imports (megatron, transformers: ~10 s each) when it has used 1 thread."""
    import torch.multiprocessing as mp

    from services.common.procs import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size))
    mp.start_processes(_entry, args=(world_size, fn, args, start_method == "spawn"), nprocs=world_size, join=True,
                       start_method=start_method)


def _entry(rank: int, world_size: int, fn: Callable, args: tuple, fresh_interpreter: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    fn(rank, world_size, *args)
    if fresh_interpreter:  # it would finalize at exit (see rank_exit); a forked rank leaves through os._exit already
        from services.trainer.ranks.rank_exit import exit_rank

        exit_rank(0)


def _max_over_world(value: float) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def parity_scenario(model_dir: Path, *, tp: int, pp: int) -> dict:
    """Collective: load the HF checkpoint into Megatron at (tp, pp), compare a forward with HF's, export back."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.trainer.backends.megatron import model
    from services.trainer.backends.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
    from services.trainer.checkpoint import megatron_convert
    from services.trainer.distributed import megatron_cpu
    from services.trainer.models.arch import ModelArch

    model.init_distributed(tp_size=tp, pp_size=pp, seed=SEED)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    arch = ModelArch.from_hf_config(hf.config)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    gpt = model.build_gpt(arch, model.transformer_config(arch, tp_size=tp, pp_size=pp), use_te=False).eval()
    state = megatron_convert.hf_to_megatron(load_file(model_dir / "model.safetensors"), arch, tp_rank=tp_rank,
                                            tp_size=tp, pp_rank=pp_rank, pp_size=pp)
    gpt.load_state_dict(state, strict=True)

    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    outputs: list[torch.Tensor] = []

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        logits = module(input_ids=batch, position_ids=torch.arange(16).expand(2, 16), attention_mask=causal)
        return logits, lambda out: (outputs.append(out.detach()) or out.sum() * 0, {})

    with torch.no_grad(), megatron_cpu.cuda_to_cpu():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[gpt],
                                    num_microbatches=1, seq_length=16, micro_batch_size=2, forward_only=True)
    logit_diff = logprob_diff = 0.0
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            expected = hf(input_ids=tokens).logits
            local = outputs[0]
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(shards, dim=-1)[..., :arch.vocab_size]
            targets = tokens[:, 1:]
            log_probs, _ = vocab_parallel_log_probs_and_entropy(
                local[:, :-1], targets, vocab_size=arch.vocab_size, tp_rank=tp_rank, tp_size=tp,
                group=ps.get_tensor_model_parallel_group())
            want = torch.log_softmax(expected[:, :-1], dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        logit_diff = (logits - expected).abs().max().item()
        logprob_diff = (log_probs - want).abs().max().item()

    exported = dict(megatron_convert.gather_hf_weights(
        list(gpt.named_parameters()), arch, tp_group=ps.get_tensor_model_parallel_group(), tp_rank=tp_rank,
        tp_size=tp, pp_group=ps.get_pipeline_model_parallel_group(), pp_rank=pp_rank, pp_size=pp,
        dp_rank=ps.get_data_parallel_rank()))
    exact = 1.0
    if dist.get_rank() == 0:
        saved = load_file(model_dir / "model.safetensors")
        exact = float(exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved))
    exact = -_max_over_world(-exact)  # min over ranks
    model.destroy_model_parallel()
    return {"tp": tp, "pp": pp, "tied": arch.tie_word_embeddings, "max_abs_logit_diff": _max_over_world(logit_diff),
            "max_abs_logprob_diff": _max_over_world(logprob_diff), "hf_roundtrip_exact": exact == 1.0}


def run_parity(rank: int, world_size: int, model_dirs: list[Path], out_path: Path) -> None:
    results = [parity_scenario(d, tp=tp, pp=pp) for d in model_dirs for tp, pp in LAYOUTS]
    if rank == 0:
        out_path.write_text(json.dumps(results))


def summary_line(results: list[dict]) -> str:
    logit = max(r["max_abs_logit_diff"] for r in results)
    logprob = max(r["max_abs_logprob_diff"] for r in results)
    exact = all(r["hf_roundtrip_exact"] for r in results)
    return f"max_abs_logit_diff={logit:.3g} max_abs_logprob_diff={logprob:.3g} hf_roundtrip_exact={str(exact).lower()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the per-layout results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    warnings.filterwarnings("ignore")  # megatron's "Apex/TE not installed" notes
    import megatron.core.pipeline_parallel  # noqa: F401  (imported once; the forked ranks inherit it)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dirs = [build_tiny_qwen3(tmp / name, tie_word_embeddings=tie) for name, tie in (("untied", False),
                                                                                       ("tied", True))]
        spawn(run_parity, dirs, tmp / "results.json", start_method="fork")
        results = json.loads((tmp / "results.json").read_text())
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"{'tp':>3} {'pp':>3} {'tied':>5} {'logit diff':>11} {'logprob diff':>13} {'round trip':>11}")
    for r in results:
        print(f"{r['tp']:>3} {r['pp']:>3} {str(r['tied']):>5} {r['max_abs_logit_diff']:>11.3g} "
              f"{r['max_abs_logprob_diff']:>13.3g} {str(r['hf_roundtrip_exact']):>11}")
    print(summary_line(results))


if __name__ == "__main__":
    main()
