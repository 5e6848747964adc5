"""Vision-language training over 2 gloo ranks, a tiny Qwen2.5-VL and a tiny Qwen3-VL: fsdp with each rank reading
its share of the rollout's groups (one rank all the images, the other none), megatron data-parallel, at tensor
parallelism 2 under sequence parallelism and over two pipeline stages. Every sample's images stay with it: the
log-probs before and after one rollout's two GRPO steps and each step's gradient norm and KL equal the one-process
run's within 1e-5 (float32).

One launch of tests/integration/vision_ranks_worker.py serves the tests here."""

from __future__ import annotations

import json

import pytest

from physarum import tasks
from physarum.tinyvlm import VLM_FAMILIES, build_tiny_vlm
from tests.integration.workers import run_worker

LAYOUTS = ("fsdp_2", "megatron_dp2", "megatron_tp2_sp", "megatron_pp2")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, dict]:
    dirs = [build_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{family}"), tasks.corpus(), family=family)
            for family in VLM_FAMILIES]
    out = tmp_path_factory.mktemp("vision-ranks")
    run_worker("tests.integration.vision_ranks_worker", *map(str, dirs), str(out), log_path=out / "worker.log",
               timeout_s=420)
    return json.loads((out / "one_rank.json").read_text()), json.loads((out / "results.json").read_text())


def by_sample(run: dict, key: str) -> list[list[float]]:
    """A run's per-sample results in rollout order (fsdp's ranks each hold their share's)."""
    parts = run.get("ranks", [run])
    out = [None] * sum(len(part["indexes"]) for part in parts)
    for part in parts:
        for index, values in zip(part["indexes"], part[key], strict=True):
            out[index] = values
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


@pytest.mark.parametrize("family", VLM_FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_train_as_one_with_each_samples_images(results, family, layout):
    one_rank, runs = results
    want, got = one_rank[family], runs[f"{family}/{layout}"]
    if layout == "fsdp_2":  # the images all on one rank: the other runs the tower on nothing (zero-weighted)
        with_images = {i for part in got["ranks"] for i in part["indexes"] if i in (0, 1, 4, 5)}
        assert with_images == {0, 1, 4, 5} and any(set(p["indexes"]) == {2, 3, 6, 7} for p in got["ranks"])
    assert max_diff(by_sample(got, "before"), want["before"]) <= 1e-5
    assert max_diff(by_sample(got, "after"), want["after"]) <= 1e-5
    assert max_diff(want["after"], want["before"]) > 1e-3  # the steps moved the policy
    metrics = got["ranks"][0]["metrics"] if "ranks" in got else got["metrics"]
    assert len(metrics) == len(want["metrics"]) == 2
    for g, w in zip(metrics, want["metrics"], strict=True):
        assert g["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-5)
        if "ranks" not in got:  # fsdp's ranks report their own share's losses
            assert g["train/ppo_kl"] == pytest.approx(w["train/ppo_kl"], abs=1e-5)
