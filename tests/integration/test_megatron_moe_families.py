"""DeepSeek-V3, GLM-4.7-Flash (glm4_moe_lite) and GLM-4.5/4.7 (glm4_moe) on the Megatron backend, over 2 gloo processes:
megatron-core's multi-latent attention (the first two), GLM-4.5's half-rotary attention with q/k/v bias and q/k
norms, and their sigmoid-routed MoE (expert bias, shared experts, a dense first layer; DeepSeek-V3 also with grouped
top-k and YaRN rotary scaling) give the HF model's log-probs within 1e-5 at TP=2, PP=2, EP=2, TP=2 × EP=2 and TP=2
with each expert cut over the two TP ranks (expert TP 2); a GRPO rollout's steps there match TorchBackend's (fsdp) on
the same model, as do the steps under each kind of routing replay at EP=2, and the EP=2 and expert-TP=2 HF exports
hold TorchBackend's weights under transformers' names; a backend resumed from a TP=2 × EP=2 dist-checkpoint trains as
if never stopped.

GLM-4 (glm4, dense: interleaved half rotary, norms after attention and after the MLP) gives the HF log-probs and
the fsdp steps at TP=2 and PP=2.

MiniMax-M2 (minimax_m2: q/k norms over the whole projection, cut over TP with the heads; half rotary; the expert bias
on its MoE block) does the same in every layout but routing replay, which the fsdp backend does not do for it.

GLM-5 (glm_moe_dsa: DeepSeek-V3's attention and MoE with DeepSeek sparse attention, each query attending to the keys
its indexer ranks best, fewer than the sequence) gives the HF log-probs and the fsdp steps at TP=2, PP=2 and EP=2, and
under each kind of routing replay at EP=2, and its EP=2 export holds the indexer's weights under transformers' names.

DeepSeek-V3 at TP=2 × EP=2 × expert TP 2 (four gloo ranks: each expert cut over the TP ranks, two on each EP rank)
gives the HF log-probs, the fsdp steps and, in its HF export, the fsdp backend's weights.

One launch of tests/integration/megatron_moe_families_worker.py serves the tests here, one of
tests/integration/megatron_ep_etp_worker.py the four-rank one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration import family_parity
from tests.integration.family_parity import REPLAY_SETTINGS, assert_steps_match, max_diff
from tests.integration.megatron_moe_families_worker import DENSE_LAYOUTS, EXPORTED, LAYOUTS, REPLAYED, SPARSE_LAYOUTS
from tests.integration.workers import run_worker

FAMILIES = ("deepseek_v3", "glm4_moe_lite", "glm4_moe", "minimax_m2")  # MoE, in every layout of LAYOUTS
DENSE = ("glm4",)  # GLM-4: in DENSE_LAYOUTS
SPARSE = ("glm_moe_dsa",)  # GLM-5: in SPARSE_LAYOUTS
RUNS = [(family, layout) for family in FAMILIES for layout in LAYOUTS] + [
    (family, layout) for family in DENSE for layout in DENSE_LAYOUTS] + [
    (family, layout) for family in SPARSE for layout in SPARSE_LAYOUTS]
EXPORTS = [(family, layout) for family in FAMILIES for layout in EXPORTED] + [
    (family, layout) for family in SPARSE for layout in SPARSE_LAYOUTS if layout in EXPORTED]


def _varied(family_dir: Path, out: Path, family: str) -> Path:
    """The tiny family model with norms away from 1 and a non-zero expert bias (so that a lost one shows); the
    DeepSeek-V3 one also routes by groups (2 groups of 2 experts, the best one first) under YaRN rotary scaling, the
    GLM-4.5 and GLM-4 ones have q/k/v biases (as the released models do)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(family_dir)
    if family == "deepseek_v3":
        config.n_group, config.topk_group = 2, 1
        config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4}
    if family in ("glm4_moe", "glm4"):
        config.attention_bias = True
    model = AutoModelForCausalLM.from_pretrained(family_dir, config=config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name and tensor.dim() == 1:
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif name.endswith(("e_score_correction_bias", "_proj.bias")):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))
    return family_parity.save_beside_tokenizer(model, family_dir, out / family)


@pytest.fixture(scope="module")
def model_dirs(family_model_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("moe-family-models")
    return {family: _varied(family_model_dir(family), out, family) for family in (*FAMILIES, *DENSE, *SPARSE)}


@pytest.fixture(scope="module")
def results(model_dirs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-moe-families")
    run_worker("tests.integration.megatron_moe_families_worker", str(out), *map(str, model_dirs.values()),
               log_path=out / "worker.log", timeout_s=600)
    return {**json.loads((out / "results.json").read_text()), "out": out}


@pytest.fixture(scope="module")
def torch_reference(model_dirs) -> dict:
    """TorchBackend's (the HF model's) runs of every family, and of the REPLAYED ones under each routing replay."""
    return family_parity.torch_reference(model_dirs, REPLAYED)


@pytest.mark.parametrize(("family", "layout"), RUNS)
def test_log_probs_and_grpo_steps_match_the_hf_model_on_torch_backend(results, torch_reference, family, layout):
    family_parity.assert_layout_run_matches(results[family][layout], torch_reference[family])


@pytest.mark.parametrize(("family", "layout"), EXPORTS)
def test_the_expert_parallel_export_holds_the_torch_backend_weights_under_transformers_names(results, torch_reference,
                                                                                           family, layout):
    save_dir = results["out"] / f"{family}-{layout}"
    saved = family_parity.assert_export_holds(save_dir, torch_reference[family]["weights"])
    assert {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.e_score_correction_bias"} & \
        saved.keys()  # the expert bias, on the router (DeepSeek-V3, GLM) or on the MoE block (MiniMax-M2)
    family_parity.assert_transformers_loads(save_dir, saved)


@pytest.fixture(scope="module")
def ep_etp_results(model_dirs, tmp_path_factory) -> dict:
    """DeepSeek-V3 at TP=2 × EP=2 × expert TP 2 over four gloo ranks (tests/integration/megatron_ep_etp_worker.py)."""
    out = tmp_path_factory.mktemp("megatron-ep-etp")
    run_worker("tests.integration.megatron_ep_etp_worker", str(out), str(model_dirs["deepseek_v3"]),
               log_path=out / "worker.log", timeout_s=600)
    return {**json.loads((out / "results.json").read_text())[model_dirs["deepseek_v3"].name], "out": out}


def test_expert_parallelism_and_expert_tensor_parallelism_together_train_as_the_torch_backend(ep_etp_results,
                                                                                             torch_reference):
    want = torch_reference["deepseek_v3"]
    assert max_diff(ep_etp_results["log_probs_before"], want["log_probs_before"]) <= 1e-5
    assert_steps_match(ep_etp_results["metrics"], want["metrics"])
    assert max_diff(ep_etp_results["log_probs_after"], want["log_probs_after"]) < 1e-4
    family_parity.assert_export_holds(ep_etp_results["out"] / "export", want["weights"])


@pytest.mark.parametrize("setting", REPLAY_SETTINGS)
@pytest.mark.parametrize("family", REPLAYED)
def test_routing_replay_at_expert_parallelism_2_routes_as_the_torch_backend_does(results, torch_reference, family,
                                                                                 setting):
    family_parity.assert_replay_run_matches(results[family][setting], torch_reference[family], setting)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_backend_resumed_from_a_dist_checkpoint_trains_as_if_never_stopped(results, family):
    family_parity.assert_resumed_as_never_stopped(results[family]["tp2_ep2"])
