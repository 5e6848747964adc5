"""The Megatron MoE test's two gloo ranks: `python -m tests.integration.megatron_moe_worker MODEL OUT` (a tiny
Qwen3-MoE). First megatron-core's MoE GPTModel with expert parallelism EP=2 (each rank two of the four experts, the
tokens of both ranks' sequences dispatched all-to-all) against the HF forward; then MegatronBackend, data parallel
over the two ranks with every expert on each (EP=1) and with two experts each (EP=2), trains two GRPO rollouts,
saves an HF export and a dist-checkpoint, resumes from it, and reports what the test compares with TorchBackend (at
tensor parallelism 1, and 2 with the two ranks one TP group); and
one rollout at EP=2 with a load-balancing loss, and with each kind of routing replay, at tensor parallelism 1 and 2;
and one under megatron-core's seq_aux_loss (PP=2) and global_aux_loss (EP=2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout

NUM_ROLLOUTS = 2
AUX_LOSS_COEFF = 0.5  # large, so that the load-balancing loss moves the router visibly in one rollout


def ep2_forward(model_dir: Path) -> float:
    """Collective at EP=2: max |Megatron logit - HF logit| over both ranks' own batches (of different lengths)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from services.trainer.backends.megatron import model as mcore
    from services.trainer.checkpoint import hf_io, megatron_convert
    from services.trainer.distributed.megatron_cpu import cuda_to_cpu
    from services.trainer.models.arch import ModelArch

    mcore.init_distributed(tp_size=1, pp_size=1, seed=0, ep_size=2)
    arch = ModelArch.from_hf_config(hf_io.read_config(model_dir))
    gpt = mcore.build_gpt(arch, mcore.transformer_config(arch, tp_size=1, pp_size=1), use_te=False).eval()
    state = megatron_convert.hf_to_megatron(hf_io.HFTensors(model_dir), arch,
                                            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=2)
    assert state.keys() == {name for name, _ in gpt.named_parameters()}
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            param.copy_(state[name])
    rank = dist.get_rank()
    seq = 6 + 5 * rank
    ids = torch.randint(1, arch.vocab_size, (2, seq), generator=torch.Generator().manual_seed(rank))
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad(), cuda_to_cpu():
        logits = gpt(input_ids=ids, position_ids=torch.arange(seq).expand_as(ids), attention_mask=mask)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(input_ids=ids).logits
    diff = torch.tensor([(logits[..., :arch.vocab_size] - want).abs().max().item()], dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    mcore.destroy_model_parallel()
    return float(diff)


def grpo(model_dir: Path, out_dir: Path, ep: int, tp: int = 1) -> dict:
    """Two rollouts at expert parallelism `ep` (tensor parallelism `tp`), a dist-checkpoint after the first; then a
    fresh backend resumes from it and trains the second again."""
    import torch.distributed as dist

    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    world = World(rank=dist.get_rank(), world_size=dist.get_world_size())
    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), tensor_model_parallel_size=tp,
                               expert_model_parallel_size=ep)

    backend = build()
    rollouts = [grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, r) for r in range(NUM_ROLLOUTS)]
    before = backend.compute_log_probs(rollouts[0])
    metrics = []
    for rollout_id, rollout in enumerate(rollouts):
        metrics += [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
        if rollout_id == 0:
            iterations.save_checkpoint(out_dir / "ckpt", 0, backend, world, lambda: iterations.TrainerState(
                rollout_id=0, job_id="moe", world_size=world.world_size))
    after = backend.compute_log_probs(rollouts[0])
    backend.save_hf(out_dir / "hf")
    backend.close()
    resumed = build()
    iterations.load_checkpoint(out_dir / "ckpt", resumed, world)
    resumed_metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")}
                       for m in resumed.train_rollout(rollouts[1])]
    resumed_after = resumed.compute_log_probs(rollouts[0])
    resumed.close()
    return {"log_probs_before": before, "log_probs_after": after, "metrics": metrics,
            "resumed_metrics": resumed_metrics, "resumed_log_probs_after": resumed_after}


def grpo_aux_loss(model_dir: Path, *, replay: bool = False) -> dict:
    """One rollout at EP=2 under moe_aux_loss_coeff (megatron-core's own load-balancing loss); replay: routed to an
    engine's experts too (use_rollout_routing_replay)."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG, moe_aux_loss_coeff=AUX_LOSS_COEFF,
                                                     use_rollout_routing_replay=replay), expert_model_parallel_size=2)
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    rollout = engine_routed(model_dir, rollout) if replay else rollout
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
    after = backend.compute_log_probs(rollout)
    backend.close()
    return {"metrics": metrics, "log_probs_after": after}


# megatron-core's other load-balancing losses -> the layout each runs in: seq_aux_loss at PP=2 (one data-parallel
# rank, as the single-process fsdp reference), global_aux_loss at EP=2 (its token counts over both data-parallel ranks)
LOAD_BALANCING_LAYOUTS = {"seq_aux_loss": {"pipeline_model_parallel_size": 2},
                          "global_aux_loss": {"expert_model_parallel_size": 2}}
# each step's 4 samples one padded micro-batch per data-parallel rank: seq_aux_loss sees rows, global_aux_loss one
# micro-batch per rank (its running average over micro-batches stays out of the comparison)
LOAD_BALANCING_CONFIG = {**GRPO_CONFIG, "micro_batch_size": 4, "moe_aux_loss_coeff": AUX_LOSS_COEFF}


def grpo_load_balancing(model_dir: Path, kind: str) -> dict:
    """One rollout under moe_router_load_balancing_type `kind`, in its LOAD_BALANCING_LAYOUTS layout."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**LOAD_BALANCING_CONFIG, moe_router_load_balancing_type=kind),
                              pack_sequences=False, **LOAD_BALANCING_LAYOUTS[kind])
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
    backend.close()
    return {"metrics": metrics}


def engine_routed(model_dir: Path, samples: list) -> list:
    """The samples with the experts an engine whose routers differ from the checkpoint's (Gaussian noise, fixed
    seed) routed each token to, as its return_routed_experts reports them."""
    from transformers import AutoModelForCausalLM

    from services.trainer.moe.hf_routing_replay import RoutingReplay, moe_routers

    engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, router in moe_routers(engine):
            router.weight.add_(2.0 * torch.randn(router.weight.shape, generator=generator))
        replay = RoutingReplay(engine, engine.config.num_hidden_layers)
        for sample in samples:
            with replay.recording() as recorded:
                engine(input_ids=torch.tensor([sample.tokens[:-1]]))
            sample.rollout_routed_experts = recorded[0].flatten().tolist()
    return samples


def replayed_log_probs(backend, samples: list) -> list[list[float]]:
    """The log-probs the policy gives the samples routed to their engine-routed experts (the old log-probs of
    use_rollout_routing_replay), response-aligned."""
    from services.trainer.batching.batch import build_rollout_batch

    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id,
                                routing_shape=(backend.arch.num_layers, backend.arch.moe_router_topk))
    log_probs = backend._log_probs(backend.model, batch, backend._micro_batches(batch, list(range(batch.size)),
                                                                                training=False))
    return [log_probs[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]


def grpo_routing_replay(model_dir: Path, setting: str, *, tp: int = 1, ep: int = 2,
                        save_dir: Path | None = None) -> dict:
    """One rollout at TP=tp, EP=ep under `setting` (use_rollout_routing_replay: an engine's other routing; or
    use_routing_replay): the replayed and the routers' own log-probs before it, the metrics, the log-probs after;
    the HF export in save_dir when given."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG, **{setting: True}),
                              tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    rollout = engine_routed(model_dir, grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0))
    replayed, own = replayed_log_probs(backend, rollout), backend.compute_log_probs(rollout)
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
    after = backend.compute_log_probs(rollout)
    if save_dir is not None:
        backend.save_hf(save_dir)
    backend.close()
    return {"metrics": metrics, "log_probs_after": after, "replayed_log_probs": replayed, "own_log_probs": own}


def run(rank: int, world_size: int, model_dir: Path, out_dir: Path) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    results = {"ep2_max_abs_logit_diff": ep2_forward(model_dir),
               **{f"grpo_ep{ep}": grpo(model_dir, out_dir / f"ep{ep}", ep) for ep in (1, 2)},
               **{f"grpo_tp2_ep{ep}": grpo(model_dir, out_dir / f"tp2_ep{ep}", ep, tp=2) for ep in (1, 2)},
               "grpo_aux_loss": grpo_aux_loss(model_dir),
               "grpo_aux_loss_replayed": grpo_aux_loss(model_dir, replay=True),
               **{f"grpo_{kind}": grpo_load_balancing(model_dir, kind) for kind in LOAD_BALANCING_LAYOUTS},
               **{setting: grpo_routing_replay(model_dir, setting)
                  for setting in ("use_rollout_routing_replay", "use_routing_replay")},
               # tensor parallelism 2: every expert on both ranks (EP=1), or two on each (EP=2, the EP group the TP one)
               **{f"{setting}_tp2_ep{ep}": grpo_routing_replay(model_dir, setting, tp=2, ep=ep,
                                                               save_dir=out_dir / f"{setting}_tp2_ep{ep}")
                  for setting, ep in (("use_rollout_routing_replay", 1), ("use_rollout_routing_replay", 2),
                                      ("use_routing_replay", 2))}}
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, Path(sys.argv[1]), Path(sys.argv[2]), start_method="spawn" if torch.cuda.is_available() else "fork")
