"""`python -m physarum.demo --train-backend megatron`: both demo jobs become valid Megatron TP=2 specs."""

from __future__ import annotations

from pathlib import Path

from physarum.cli import load_job_file
from physarum.demo import EXAMPLES, backend_overrides
from services.trainer.api.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_jobs_run_on_megatron_at_tp2():
    assert backend_overrides("fsdp", 1) == []
    for name in ("sft.yaml", "job.yaml"):
        spec = parse_spec(load_job_file(REPO / EXAMPLES / name, [*backend_overrides("megatron", 2), "lr=0.5"]))
        assert (spec.train_backend, spec.tensor_model_parallel_size, spec.lr) == ("megatron", 2, 0.5), name
