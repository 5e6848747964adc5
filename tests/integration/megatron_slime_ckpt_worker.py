"""One gloo rank for test_megatron_slime_checkpoint: checkpoints in slime's layout written by megatron-core's own
dist_checkpointing.save (as Megatron-LM writes them: the model's sharded tensors under Megatron's keys, an argparse
Namespace in the common state), then read back by MegatronBackend as --ref-load (`release`), --opd-teacher-load
(`iter_0000003`) and --load, and converted to an HF directory (slime_to_hf); and a trained backend's own checkpoint
(slime's --save) read back as Megatron-LM's load_checkpoint reads it, by megatron-core's dist_checkpointing.load into
fresh models, and by Physarum's loaders.

Run: python -m tests.integration.megatron_slime_ckpt_worker OUT_DIR  (writes OUT_DIR/results.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import build_tiny_qwen3, spawn
from testkit.grpo_rollout import grpo_rollout
from tests.integration.megatron_opd_worker import hf_log_probs

CONFIG = {"n_samples_per_prompt": 2, "global_batch_size": 4, "use_kl_loss": True, "use_opd": True,
          "opd_type": "megatron"}


def save_slime_layout(gpt, root: Path, iteration: str) -> None:
    """Megatron-LM's save: {root}/release or iter_N/ by dist_checkpointing.save, then the latest file."""
    from megatron.core import dist_checkpointing

    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    (root / name).mkdir(parents=True)
    state = {"model": gpt.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0,
             "args": argparse.Namespace(hidden_size=64)}  # what Megatron-LM pickles into common.pt
    dist_checkpointing.save(state, str(root / name))
    (root / "latest_checkpointed_iteration.txt").write_text(iteration)


def megatron_lm_load(backend, path: Path) -> tuple[dict, dict]:
    """What Megatron-LM's load_checkpoint does with a torch_dist directory (slime's --load): its common state, then
    the model and optimizer requested under the checkpoint's content metadata, loaded by dist_checkpointing.load
    into `backend`'s freshly built model and optimizer."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    common = dist_checkpointing.load_common_state_dict(str(path))
    metadata = {**dist_checkpointing.load_content_metadata(preloaded_state_dict=common),
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    backend._init_optimizer_state()  # torch's Adam has no state before its first step (Megatron-LM's GPU Adams do)
    model = backend.gpt.sharded_state_dict(metadata=metadata)
    request = {"model": model, "optimizer": backend.optimizer.sharded_state_dict(model, is_loading=True,
                                                                                 metadata=metadata)}
    loaded = dist_checkpointing.load(request, str(path))
    backend.gpt.load_state_dict(loaded["model"])
    with torch.no_grad():
        backend.optimizer.load_state_dict(loaded["optimizer"])
    return common, metadata


def optimizer_moments(backend) -> list[torch.Tensor]:
    inner = [opt.optimizer for opt in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])]
    return [state[key] for opt in inner for state in opt.state.values() for key in ("exp_avg", "exp_avg_sq")]


def save_round_trip(trained, root: Path, student_dir: Path, world) -> dict:
    """slime's --save on the megatron backend: the checkpoint of rollout 3, read back four ways; each compared
    parameter by parameter with the trained model."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint import iterations
    from services.trainer.settings.train import TrainConfig

    path = iterations.save_checkpoint(root, 3, trained, world, lambda: iterations.TrainerState(
        rollout_id=3, job_id="saver", world_size=1))
    want = {name: p.detach().clone() for name, p in trained.gpt.named_parameters()}
    want_moments = optimizer_moments(trained)

    def max_diffs(backend) -> dict[str, float]:
        got = dict(backend.gpt.named_parameters())
        return {name: (got[name] - value).abs().max().item() for name, value in want.items()}

    result = {"files": sorted(p.name for p in path.iterdir()), "latest": (root / iterations.LATEST_FILE).read_text(),
              "is_slime_layout": iterations.slime_checkpoint(root) is not None}
    fresh = MegatronBackend(student_dir, TrainConfig(**CONFIG))  # a freshly built model: the student's weights
    result["fresh_diffs"] = max_diffs(fresh)
    common, metadata = megatron_lm_load(fresh, path)
    result.update(megatron_lm_diffs=max_diffs(fresh), megatron_lm_moment_diffs=[
        (got - w).abs().max().item() for got, w in zip(optimizer_moments(fresh), want_moments, strict=True)],
        iteration=common["iteration"], checkpoint_version=common["checkpoint_version"],
        args=vars(common["args"]), opt_param_scheduler=common["opt_param_scheduler"],
        content_metadata={k: v for k, v in metadata.items() if k != "dp_cp_group"})
    fresh.close()

    resumed = MegatronBackend(student_dir, TrainConfig(**CONFIG))  # Physarum's --load of the same root
    state = iterations.load_checkpoint(root, resumed, world)
    result.update(resumed_rollout_id=state.rollout_id, resumed_diffs=max_diffs(resumed),
                  resumed_num_steps=resumed._num_steps, trained_num_steps=trained._num_steps)
    iterations.load_reference(root, resumed, world)  # --ref-load of the root: its policy
    ref = dict(resumed.ref_model.named_parameters())
    result["ref_diffs"] = {name: (ref[name] - value).abs().max().item() for name, value in want.items()}
    resumed.load_megatron_checkpoint(path, "teacher")  # the torch_dist reader of slime's checkpoints
    teacher = dict(resumed.teacher_model.named_parameters())
    result["teacher_diffs"] = {name: (teacher[name] - value).abs().max().item() for name, value in want.items()}
    resumed.close()
    return result


def run(rank: int, world_size: int, out_dir: Path, student_dir: Path, teacher_dir: Path) -> None:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.batching.batch import build_rollout_batch
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    world = World()
    as_policy = MegatronBackend(teacher_dir, TrainConfig(n_samples_per_prompt=2))
    save_slime_layout(as_policy.gpt, out_dir / "release-root", "release")
    save_slime_layout(as_policy.gpt, out_dir / "iter-root", "3")
    as_policy.close()

    backend = MegatronBackend(student_dir, TrainConfig(**CONFIG))
    samples = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id)
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    micro = backend._micro_batches(batch, list(range(batch.size)), training=False)

    def log_probs(model) -> list[list[float]]:
        out = backend._log_probs(model, batch, micro)
        return [out[i, :s.response_length].tolist() for i, s in enumerate(samples)]

    iterations.load_reference(out_dir / "release-root", backend, world)
    iterations.load_teacher(out_dir / "iter-root", backend, world)
    results = {"ref": log_probs(backend.ref_model), "teacher": log_probs(backend.teacher_model),
               "policy_before": log_probs(backend.model)}
    backend.load_megatron_checkpoint(iterations.slime_checkpoint(out_dir / "iter-root"), "model")
    results["policy_after"] = log_probs(backend.model)
    results["metrics"] = backend.train_rollout(samples)
    results["saved"] = save_round_trip(backend, out_dir / "saved", student_dir, world)
    backend.close()
    from services.trainer.driver.slime_to_hf import convert

    converted = convert(student_dir, out_dir / "iter-root", out_dir / "converted")  # fsdp's way in
    results.update(student_hf=hf_log_probs(student_dir, samples), teacher_hf=hf_log_probs(teacher_dir, samples),
                   converted_hf=hf_log_probs(converted, samples))
    (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    student, teacher = (build_tiny_qwen3(out / name, tie_word_embeddings=False, seed=seed)
                        for name, seed in (("student", 0), ("teacher", 1)))
    spawn(run, out, student, teacher, world_size=1, start_method="spawn")
