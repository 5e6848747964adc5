"""slime's torch_dist checkpoints on the Megatron backend: written by megatron-core's own dist_checkpointing.save in
slime's layout (`release` and `iter_0000003`, an argparse Namespace in the common state that is never unpickled),
read as --ref-load, --opd-teacher-load and --load, and converted to an HF directory; each loaded model's log-probs
are the HF weights' own. A trained backend's own checkpoint (--save) read back as Megatron-LM reads it. One launch of
tests/integration/megatron_slime_ckpt_worker.py (one gloo rank); then an fsdp backend given the same slime checkpoints,
converted at job start."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-slime-ckpt")
    run_worker("tests.integration.megatron_slime_ckpt_worker", str(out), log_path=out / "worker.log", timeout_s=300)
    return {**json.loads((out / "results.json").read_text()), "out": str(out)}


def flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def test_slimes_checkpoints_load_as_reference_teacher_and_policy(results):
    teacher = pytest.approx(flat(results["teacher_hf"]), abs=1e-4)
    assert flat(results["ref"]) == teacher  # --ref-load X_torch_dist (release)
    assert flat(results["teacher"]) == teacher  # --opd-teacher-load (iter_0000003)
    assert flat(results["policy_before"]) == pytest.approx(flat(results["student_hf"]), abs=1e-4)
    assert flat(results["policy_after"]) == teacher  # --load: the weights
    assert all(math.isfinite(m["train/loss"]) for m in results["metrics"])


def test_the_conversion_to_hf_gives_the_checkpoints_weights(results):
    """train_backend fsdp reads slime's checkpoints through an HF directory that slime_to_hf writes."""
    assert flat(results["converted_hf"]) == pytest.approx(flat(results["teacher_hf"]), abs=1e-5)


def test_a_saved_checkpoint_is_megatron_lms_and_round_trips_parameter_by_parameter(results):
    """slime's --save on train_backend megatron: iter_0000003/ holds Megatron-LM's torch_dist files (beside Physarum's
    trainer state and RNG files) and latest_checkpointed_iteration.txt names it; dist_checkpointing.load, asked as
    Megatron-LM's load_checkpoint asks, gives fresh models the trained weights and Adam moments exactly, and so do
    Physarum's loaders (--load resumes at rollout 4, --ref-load, the torch_dist reader)."""
    saved = results["saved"]
    assert saved["latest"] == "3\n"
    assert {"metadata.json", "common.pt", ".metadata", "__0_0.distcp", "trainer_state.json",
            "rng_rank0.pt"} <= set(saved["files"])
    assert not saved["is_slime_layout"]  # trainer_state.json: Physarum resumes it in full
    assert max(saved["fresh_diffs"].values()) > 1e-4  # the fresh model starts elsewhere
    for key in ("megatron_lm_diffs", "resumed_diffs", "ref_diffs", "teacher_diffs"):
        assert saved[key].keys() == saved["fresh_diffs"].keys(), key
        assert max(saved[key].values()) == 0.0, key
    assert saved["megatron_lm_moment_diffs"] and max(saved["megatron_lm_moment_diffs"]) == 0.0
    # what Megatron-LM's load_checkpoint reads beside the tensors
    assert (saved["iteration"], saved["checkpoint_version"]) == (3, 3.0)
    assert saved["content_metadata"] == {"distrib_optim_sharding_type": "dp_reshardable",
                                         "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    args = saved["args"]
    assert (args["num_layers"], args["hidden_size"], args["num_attention_heads"]) == (2, 64, 4)
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (1, 1)
    assert args["no_save_rng"] and not args["no_save_optim"]
    # slime's scheduler counts samples: 2 optimizer steps of global_batch_size 4 (lr 1e-6, constant by default)
    scheduler = saved["opt_param_scheduler"]
    assert (scheduler["num_steps"], scheduler["max_lr"], args["consumed_train_samples"]) == (8, 1e-6, 8)
    assert (saved["resumed_rollout_id"], saved["resumed_num_steps"]) == (3, saved["trained_num_steps"])


def test_an_fsdp_job_converts_slimes_checkpoints_at_start_and_starts_from_their_weights(results, tmp_path,
                                                                                         monkeypatch):
    """train_backend fsdp given slime's torch_dist checkpoints (--load iter_0000003, --ref-load release): rank 0
    converts each once into the job's save root, and the backend's policy and reference start from the teacher's
    weights, tensor by tensor; a restarted job reuses the HF copies."""
    from safetensors.torch import load_file

    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.distributed import parallel
    from services.trainer.distributed.parallel import World
    from services.trainer.driver import loop, slime_checkpoint_conversion
    from services.trainer.settings.driver import DriverConfig
    from services.trainer.settings.train import TrainConfig

    out, world = Path(results["out"]), World()
    driver = DriverConfig(hf_checkpoint=str(out / "student"), prompt_data=str(tmp_path / "unused.jsonl"),
                          num_rollout=1, load=str(out / "iter-root"), ref_load=str(out / "release-root"),
                          save=str(tmp_path / "save"))
    converted = slime_checkpoint_conversion.converted_paths(driver, world)
    assert Path(converted.load).parent == Path(converted.ref_load).parent == tmp_path / "save" / "slime_hf"
    assert Path(converted.load).name.startswith("iter-root-iter_0000003-")

    backend = TorchBackend(out / "student", TrainConfig(n_samples_per_prompt=2, use_kl_loss=True), world=world)
    assert loop.resume(converted, backend, None, world) == 0  # slime's finetune case: weights, rollout 0
    teacher = load_file(out / "teacher" / "model.safetensors")
    student = load_file(out / "student" / "model.safetensors")
    for model in (dict(backend.named_weights()), parallel.full_state_dict(backend.ref_model, world)):
        assert model.keys() == teacher.keys()
        for name, weight in teacher.items():
            assert torch.equal(model[name].float().cpu(), weight), name
        assert any(not torch.equal(student[name], weight) for name, weight in teacher.items())

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(slime_checkpoint_conversion.subprocess, "run", no_conversion)
    assert slime_checkpoint_conversion.converted_paths(driver, world) == converted  # a restarted job: the same copies
