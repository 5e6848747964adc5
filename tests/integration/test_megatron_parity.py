"""MegatronBackend on 2 gloo processes: HF parity at TP=1/TP=2/PP=2, the first ten GRPO steps across layouts and
against TorchBackend on the same data, and an exact resume from a dist-checkpoint.

One launch of tests/integration/megatron_worker.py (2 ranks) serves every test here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bench.megatron_parity import summary_line
from services.trainer.settings.train import TrainConfig
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from tests.integration.megatron_worker import CKPT_ROLLOUT, NUM_ROLLOUTS, SFT_CONFIG
from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron")
    run_worker("tests.integration.megatron_worker", str(tiny_model_dir), str(out), log_path=out / "worker.log",
               timeout_s=180)
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def torch_reference(tiny_model_dir) -> dict:
    from services.trainer.backends.fsdp.backend import TorchBackend

    backend = TorchBackend(tiny_model_dir, TrainConfig(**GRPO_CONFIG), num_threads=1)
    rollouts = [grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, r) for r in range(NUM_ROLLOUTS)]
    samples = rollouts[0]
    before = backend.compute_log_probs(samples)
    # perf/ keys are timings, not results: the runs compare what they train
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")}
               for rollout in rollouts for m in backend.train_rollout(rollout)]
    return {"metrics": metrics, "log_probs_before": before, "log_probs_after": backend.compute_log_probs(samples),
            "weights": dict(backend.named_weights())}


def test_megatron_matches_hf_logits_log_probs_and_weights(results):
    parity = results["parity"]
    assert {(r["tp"], r["pp"], r["tied"]) for r in parity} == {(tp, pp, tied) for tp, pp in ((1, 1), (2, 1), (1, 2))
                                                               for tied in (False, True)}
    for r in parity:
        assert r["max_abs_logit_diff"] <= 1e-5, r
        assert r["max_abs_logprob_diff"] <= 1e-5, r
        assert r["hf_roundtrip_exact"], r
    line = summary_line(parity)
    match = re.fullmatch(r"max_abs_logit_diff=(\S+) max_abs_logprob_diff=(\S+) hf_roundtrip_exact=(true|false)", line)
    assert match and float(match[1]) <= 1e-5 and float(match[2]) <= 1e-5 and match[3] == "true"


def assert_same_metrics(got: list[dict], want: list[dict], what: str, steps: int = 2 * NUM_ROLLOUTS) -> None:
    assert len(got) == len(want) == steps, what
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), (what, step)
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=2e-5, rel=1e-4), (what, step, key)


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_first_ten_grpo_steps_match_across_layouts(results):
    base, *others = results["grpo"]
    assert (base["tp"], base["pp"]) == (1, 1)
    step1, step2 = base["metrics"][:2]
    # the second step sees the policy the first one moved, and every loss term is live
    assert step1["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6) and abs(step2["train/ppo_kl"]) > 1e-4
    assert step1["train/pg_loss"] != 0.0 and step1["train/grad_norm"] > 0 and "train/tis" in step1
    losses = [m["train/loss"] for m in base["metrics"]]
    assert len(set(losses)) == len(losses)  # ten distinct steps, not one repeated
    assert {(r["tp"], r["pp"]) for r in others} == {(2, 1), (1, 2)}
    for other in others:
        what = f"tp{other['tp']} pp{other['pp']} vs tp1 (dp2)"
        assert_same_metrics(other["metrics"], base["metrics"], what)
        assert max_diff(other["log_probs_after"], base["log_probs_after"]) < 1e-4, what
    for run in results["grpo"]:
        assert abs(step2["train/kl_loss"]) > 1e-4 and abs(run["kl_after_ref_update"]) < 1e-6  # ref = policy again
        # load() puts the checkpoint's weights back
        assert max_diff(run["log_probs_reloaded"], run["log_probs_before"]) < 1e-6
        assert max_diff(run["log_probs_after"], run["log_probs_before"]) > 1e-3


def test_first_ten_grpo_steps_match_torch_backend(results, torch_reference):
    from safetensors.torch import load_file

    for run in results["grpo"]:
        what = f"megatron tp{run['tp']} pp{run['pp']} vs TorchBackend"
        assert max_diff(run["log_probs_before"], torch_reference["log_probs_before"]) < 1e-5, what
        assert_same_metrics(run["metrics"], torch_reference["metrics"], what)
        assert max_diff(run["log_probs_after"], torch_reference["log_probs_after"]) < 1e-4, what
        saved = load_file(Path(run["save_dir"]) / "model.safetensors")
        assert saved.keys() == torch_reference["weights"].keys(), what
        for name, weight in torch_reference["weights"].items():
            torch.testing.assert_close(saved[name], weight, atol=1e-4, rtol=0, msg=f"{what}: {name}")
    # the saved directory is a complete HF model
    assert (Path(results["grpo"][0]["save_dir"]) / "tokenizer.json").is_file()


def test_a_backend_resumed_from_a_dist_checkpoint_trains_as_if_never_stopped(results):
    for run in results["grpo"]:
        what = f"tp{run['tp']} pp{run['pp']}"
        # Megatron-LM's torch_dist files in iter_N/ itself (slime's --load reads them) beside Physarum's own
        assert {"metadata.json", "common.pt", ".metadata", "rng_rank0.pt", "rng_rank1.pt",
                "trainer_state.json"} <= set(run["checkpoint_files"]), what
        assert (run["resumed_rollout_id"], run["resumed_version"]) == (CKPT_ROLLOUT, CKPT_ROLLOUT + 1), what
        # the steps after the checkpoint, and the weights they end with: the same as the run that never stopped
        never_stopped = run["metrics"][2 * (CKPT_ROLLOUT + 1):]
        assert_same_metrics(run["resumed_metrics"], never_stopped, what, steps=2 * (NUM_ROLLOUTS - CKPT_ROLLOUT - 1))
        for got, want in zip(run["resumed_metrics"], never_stopped, strict=True):
            assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-6), what
        assert max_diff(run["resumed_log_probs_after"], run["log_probs_after"]) < 1e-6, what
        assert run["resumed_max_weight_diff"] < 1e-6, what
        # ref_load of a checkpoint root: its policy becomes the reference model
        assert max_diff(run["ref_loaded_log_probs"], run["log_probs_at_checkpoint"]) < 1e-6, what


def test_sft_and_custom_loss_at_tp2_match_torch_backend(results, tiny_model_dir):
    from services.trainer.backends.fsdp.backend import TorchBackend

    backend = TorchBackend(tiny_model_dir, TrainConfig(**SFT_CONFIG, loss_type="sft_loss"), num_threads=1)
    want = [{k: v for k, v in m.items() if not k.startswith("perf/")}  # timings, not results
            for m in backend.train_rollout(grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id))]
    sft, custom = results["sft_tp2"]["sft"], results["sft_tp2"]["custom"]
    assert_same_metrics(sft, want, "sft tp2 vs TorchBackend", steps=2)
    for got, ref in zip(custom, want, strict=True):  # the same masked mean NLL through logits gathered over TP
        for key in ("train/loss", "train/grad_norm"):
            assert got[key] == pytest.approx(ref[key], abs=2e-5, rel=1e-4), key
        assert got["train/nll"] == pytest.approx(got["train/loss"])
