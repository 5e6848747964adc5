"""bf16 training on CPU, both backends: bfloat16 compute, float32 master weights, log-probs and losses; results
within bf16's rounding of the float32 run on the same data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.settings.train import TrainConfig
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout

REPO = Path(__file__).resolve().parents[2]


def fsdp_run(model_dir, bf16: bool) -> tuple[TorchBackend, list[dict], list[list[float]]]:
    backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, bf16=bf16), num_threads=1)
    samples = grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id)
    metrics = backend.train_rollout(samples)
    return backend, metrics, backend.compute_log_probs(samples)


def close(a: list[list[float]], b: list[list[float]], tol: float) -> bool:
    return all(abs(x - y) <= tol for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def test_fsdp_bf16_computes_in_bf16_with_fp32_master_weights(tiny_model_dir):
    backend, metrics, log_probs = fsdp_run(tiny_model_dir, bf16=True)
    _, ref_metrics, ref_log_probs = fsdp_run(tiny_model_dir, bf16=False)
    assert {p.dtype for p in backend.model.parameters()} == {torch.float32}  # master weights
    assert {s["exp_avg"].dtype for s in backend.optimizer.state.values()} == {torch.float32}
    batch = build_rollout_batch(grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id))
    assert backend._logits(backend.model, batch.select(0, 2)).dtype == torch.bfloat16  # the forward ran in bf16
    assert all(isinstance(v, float) for v in log_probs[0])
    assert not close(log_probs, ref_log_probs, 0.0)  # bf16 did change the arithmetic ...
    assert close(log_probs, ref_log_probs, 0.1)  # ... within its rounding
    for got, want in zip(metrics, ref_metrics, strict=True):
        assert got["train/pg_loss"] == pytest.approx(want["train/pg_loss"], abs=2e-3)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=0.05)


def test_megatron_bf16_params_with_fp32_main_params(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.integration.precision_worker", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    bf16, fp32 = results["bf16"], results["fp32"]
    assert fp32["param_dtypes"] == ["torch.float32"] and fp32["main_param_dtypes"] == ["torch.float32"]
    assert fp32["num_checked"] > 100  # Megatron's step ran under the device check
    assert "torch.bfloat16" in bf16["param_dtypes"] and bf16["main_param_dtypes"] == ["torch.float32"]
    assert not close(bf16["log_probs"], fp32["log_probs"], 0.0)
    assert close(bf16["log_probs"], fp32["log_probs"], 0.1)
    for got, want in zip(bf16["metrics"], fp32["metrics"], strict=True):
        assert got["train/pg_loss"] == pytest.approx(want["train/pg_loss"], abs=2e-3)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=0.05)
