"""Two FSDP2 trainer ranks (processes, gloo; data-parallel, or one context-parallel group that splits every
sequence) train exactly like one process on the same rollouts: the same per-step losses and metrics, the same
weights in their HF export, and a checkpoint one process resumes from."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.shares import Share
from services.trainer.api.spec import parse_spec
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import World, shard_rollout
from services.trainer.driver.loop import make_backend
from tests.integration.trainer_ranks import BASE, CASES, NUM_ROLLOUTS, make_samples, run_case
from tests.integration.workers import run_ranks


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("two-ranks")
    run_ranks("tests.integration.trainer_ranks", str(out), str(tiny_model_dir), log_dir=out, timeout_s=240)
    return out, json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-rank")
    return out, {name: run_case(name, tiny_model_dir, out, World()) for name in CASES}


def assert_same_steps(ranks_metrics: list, single_metrics: list, tolerance: dict) -> None:
    assert len(ranks_metrics) == NUM_ROLLOUTS and all(len(steps) == 2 for steps in ranks_metrics)
    for ranks_steps, single_steps in zip(ranks_metrics, single_metrics, strict=True):
        for ranks, single in zip(ranks_steps, single_steps, strict=True):
            assert ranks.keys() == single.keys()
            for key, value in single.items():
                assert ranks[key] == pytest.approx(value, **tolerance), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_the_losses_of_one_process(two_ranks, one_rank, case):
    dp_metrics, (single_metrics, _) = two_ranks[1][case], one_rank[1][case]
    # bf16: the same steps up to bf16 rounding (the ranks cast parameters, one process casts each op's inputs)
    assert_same_steps(dp_metrics, single_metrics,
                      {"rel": 3e-2, "abs": 2e-3} if case == "bf16" else {"rel": 1e-4, "abs": 1e-6})
    assert abs(single_metrics[1][1]["train/ppo_kl"]) > 1e-6  # the second step saw the policy the first one moved
    if case == "per_token_kl":  # the reference model followed the policy (ref_update_interval 1)
        assert single_metrics[1][0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.slow  # four ranks on two cores: about a minute
def test_two_data_parallel_shares_of_two_context_parallel_ranks_give_the_losses_of_one_process(
        one_rank, tiny_model_dir, tmp_path):
    # four ranks: context-parallel groups {0, 1} and {2, 3}, each training one of the step's two groups of samples
    run_ranks("tests.integration.trainer_ranks", str(tmp_path), str(tiny_model_dir), "context_parallel",
              log_dir=tmp_path, timeout_s=600, world_size=4)
    four = json.loads((tmp_path / "metrics.json").read_text())["context_parallel"]
    assert_same_steps(four, one_rank[1]["context_parallel"][0], {"rel": 1e-4, "abs": 1e-6})


def test_save_hf_of_the_sharded_model_loads_in_transformers(two_ranks, one_rank):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, backend = one_rank[1]["grpo"]
    expected = dict(backend.named_weights())
    exported = AutoModelForCausalLM.from_pretrained(two_ranks[0] / "grpo" / "hf", dtype=torch.float32).state_dict()
    assert set(exported) - set(expected) == {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=2e-6, rtol=0, msg=name)
    tokenizer = AutoTokenizer.from_pretrained(two_ranks[0] / "grpo" / "hf")
    assert tokenizer.decode(tokenizer.encode("12+34=")) == "12+34="


def test_one_process_resumes_a_two_rank_checkpoint_exactly(two_ranks, one_rank, tiny_model_dir):
    _, reference = one_rank[1]["grpo"]
    spec = parse_spec({**BASE, "hf_checkpoint": str(tiny_model_dir)})
    resumed = make_backend(spec, World(), num_threads=1)
    state = iterations.load_checkpoint(two_ranks[0] / "grpo" / "ckpt", resumed, World())
    assert (state.rollout_id, state.world_size, resumed.weight_version) == (NUM_ROLLOUTS - 1, 2, NUM_ROLLOUTS)
    samples = make_samples(tiny_model_dir)
    shard = shard_rollout(samples, Share(), n_samples_per_prompt=2)
    # The next rollout trains the same way from the checkpoint as from the never-stopped model: the optimizer's
    # moments and step counts, and the learning-rate schedule, came back.
    for got, want in zip(resumed.train_rollout(shard), reference.train_rollout(shard), strict=True):
        for key, value in want.items():
            if not key.startswith("perf/"):  # timings, not results
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_lora_over_two_ranks_exports_the_adapter_one_process_trains(two_ranks, one_rank):
    from safetensors.torch import load_file

    _, backend = one_rank[1]["lora"]
    exported = load_file(two_ranks[0] / "lora" / "hf" / "adapter_model.safetensors")
    adapters = {f"base_model.model.{name}": p for name, p in backend.model.named_parameters() if "lora_" in name}
    assert set(exported) == set(adapters)
    # Adam moves each entry by about lr (1e-2) per step whatever its gradient's size, so the reduction order of the
    # two ranks' gradients shows up to ~1e-5 in the four steps' result
    for name, tensor in adapters.items():
        torch.testing.assert_close(exported[name], tensor.detach(), atol=1e-4, rtol=0, msg=name)
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in exported.items())
