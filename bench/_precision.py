"""The GPU check's comparison of one run on CUDA with the same run on CPU (bench/gpu_check.py, gpu_families.py):
float32 losses and log-probs must match within the tolerances; bf16 is reported beside them."""

from __future__ import annotations

LOSS_TOL, LOG_PROB_TOL = 1e-5, 1e-4
LOSS_KEYS = ("train/pg_loss", "train/kl_loss", "train/entropy_loss")


def precision_rows(fp32_name: str, bf16_name: str, cpu: dict, fp32: dict, bf16: dict) -> list[tuple[str, bool, str]]:
    """Two table rows from three runs' {"metrics": [per step], "log_probs": [per sample]}: float32 on CUDA against
    float32 on CPU (pass or fail), and bf16 on CUDA (reported)."""
    loss_diff = max(abs(a[k] - b[k]) for a, b in zip(cpu["metrics"], fp32["metrics"], strict=True)
                    for k in LOSS_KEYS if k in a)
    lp_diff = max(abs(x - y) for ra, rb in zip(cpu["log_probs"], fp32["log_probs"], strict=True)
                  for x, y in zip(ra, rb, strict=True))
    bf16_diff = max(abs(a["train/pg_loss"] - b["train/pg_loss"])
                    for a, b in zip(cpu["metrics"], bf16["metrics"], strict=True))
    return [(fp32_name, loss_diff <= LOSS_TOL and lp_diff <= LOG_PROB_TOL,
             f"max loss diff {loss_diff:.2e} (≤ {LOSS_TOL}), max log-prob diff {lp_diff:.2e}"),
            (bf16_name, True, f"pg_loss diff vs fp32 CPU {bf16_diff:.2e}; "
                              f"grad norms {[round(m['train/grad_norm'], 4) for m in bf16['metrics']]}")]
