"""The sequence-parallelism test's two gloo ranks: `python -m tests.integration.megatron_sp_worker DENSE MOE OUT`
(a tiny Qwen3 and a tiny Qwen3-MoE). Each model trains one GRPO rollout of micro-batches of three samples (rows of
odd lengths, padded for sequence parallelism) at tensor parallelism 1 (data parallel over the two ranks) and at 2
with megatron.sequence_parallel, packed and as padded rectangles; the MoE under a load-balancing loss, its experts
on both ranks (EP=1) or two on each (EP=2), and under each kind of routing replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.megatron_parity import spawn
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from tests.integration.megatron_moe_worker import engine_routed, replayed_log_probs

AUX_LOSS_COEFF = 0.5
CONFIG = {**GRPO_CONFIG, "micro_batch_size": 3}


def grpo(model_dir: Path, *, tp: int, pack: bool, ep: int = 1, aux_loss: float = 0.0, replay: str = "") -> dict:
    """One rollout at tensor parallelism `tp` (2: under megatron.sequence_parallel): the log-probs before and
    after, the metrics of its two steps. replay: that routing replay setting, the rollout routed by an engine whose
    routers differ, its replayed log-probs too."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**CONFIG, moe_aux_loss_coeff=aux_loss,
                                                     **({replay: True} if replay else {})),
                              tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pack_sequences=pack,
                              megatron_args={"sequence_parallel": True} if tp > 1 else None)
    assert backend.gpt.config.sequence_parallel == (tp > 1)
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    rollout = engine_routed(model_dir, rollout) if replay else rollout
    replayed = replayed_log_probs(backend, rollout) if replay else []
    before = backend.compute_log_probs(rollout)
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
    after = backend.compute_log_probs(rollout)
    backend.close()
    return {"log_probs_before": before, "metrics": metrics, "log_probs_after": after, "replayed_log_probs": replayed}


def run(rank: int, world_size: int, dense_dir: Path, moe_dir: Path, out_dir: Path) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    results = {}
    for pack in (True, False):
        for tp in (1, 2):
            results[f"dense_tp{tp}_pack{pack}"] = grpo(dense_dir, tp=tp, pack=pack)
            results[f"moe_tp{tp}_pack{pack}"] = grpo(moe_dir, tp=tp, pack=pack, aux_loss=AUX_LOSS_COEFF)
    results["moe_tp2_ep2_packTrue"] = grpo(moe_dir, tp=2, ep=2, pack=True, aux_loss=AUX_LOSS_COEFF)
    results["moe_tp1_ep2_packTrue"] = grpo(moe_dir, tp=1, ep=2, pack=True, aux_loss=AUX_LOSS_COEFF)
    for tp in (1, 2):  # the engine's experts on both ranks, packed; the policy's own at EP=2, as rectangles
        results[f"rollout_replay_tp{tp}_packTrue"] = grpo(moe_dir, tp=tp, pack=True,
                                                          replay="use_rollout_routing_replay")
        results[f"replay_tp{tp}_ep2_packFalse"] = grpo(moe_dir, tp=tp, ep=2, pack=False, replay="use_routing_replay")
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]),
          start_method="spawn" if torch.cuda.is_available() else "fork")
