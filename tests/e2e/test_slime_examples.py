"""End to end: every slime example script that Physarum accepts at submit (tests/slime_examples/launch_args.json),
and the dense scripts/run-*.sh of the families megatron builds (tests/data/slime_launch_scripts.json; DENSE_LEFT_OUT
says why each other one does not run), runs two rollouts to SUCCEEDED through the whole stack on a tiny model of its
family, its argv converted by the job API as `physarum submit --slime-args` sends it. Only the model, parallelism,
sizes and paths change (tests/e2e/slime_tiny.py names each flag and why); algorithm, rollout mode, hooks, plugins
and eval settings stay as slime's script wrote them.

The scripts are megatron-typed (slime's default backend) and run on megatron, the family of each one megatron-core
builds here (Qwen2.5, Qwen3, Qwen3-MoE, GLM-4, Qwen3.5, Qwen3.5-MoE and Qwen3-Next with their gated delta-net layers,
and MiMo: a tiny Qwen2 with one MTP layer under MiMo's names, which run-mimo-7B-rl-eagle.sh trains beside the
policy, as run-glm4.7-30B-A3B.sh does the tiny GLM-4.7-Flash's); a script whose family megatron refused, with a
refusal that names fsdp, would run moved to fsdp as docs/slime.md's porting section says (ON_FSDP). slime's geo3k
VLM example runs on a tiny Qwen3.5-MoE with its vision tower (megatron's language model, transformers' tower), each
prompt row an image.
train_infer_mismatch_helper runs on megatron with slime's mis.py and mis.yaml unchanged (from
tests/slime_examples/examples), at context parallelism 1 like every script here (one trainer rank). multi_agent
(slime's multi-agent generate function, from there too, on a tiny Qwen3-MoE) and run-qwen3-32B.sh run with their
optimizer offloaded to the host (--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
--use-precision-aware-optimizer, megatron-core's hybrid optimizer).

One stack per family (redis, buffer, reward, router, rollout manager with one CPU engine, one trainer rank), started
once for the module and shared by that family's examples, with the plugins' folders on its services' PYTHONPATH
and their modules on its allow-list, as slime's scripts put them on PYTHONPATH. Outside services have local
stand-ins: Search-R1's retrieval server (its URL set in the user's copy of the example, as a Search-R1 user edits
SEARCH_R1_CONFIGS), retool's sandbox (in the rollout service, as in slime), W&B for `--use-wandb` (offline mode,
WANDB_MODE), and slime's OPD teacher at `--rm-url` (the stack's own engine). 2 minutes on 2 cores at load 9 (4.5 at
load 20), most of it starting the four stacks (each job takes seconds once its stack is up): multi_agent's 28 s
include its Qwen3-MoE stack's start, train_infer_mismatch_helper's 2 s share the Qwen3 stack.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import time
from pathlib import Path

import pytest
import yaml

from physarum import stack
from services.buffer.client import BufferClient
from services.common.errors import InvalidArgument
from services.common.plugins import ALLOWLIST_ENV
from services.rollout.generation.prompts import PromptEncoder
from services.trainer.api.client import JobsRestClient
from tests.e2e.roots import stack_roots
from tests.e2e.slime_tiny import build_tiny_model, split_flags, tiny_argv
from tests.e2e.test_loop import engine_urls, run
from tests.integration.slime_fixtures import JsonServer
from tests.unit.test_slime_examples import DENSE, EXAMPLES, HF_CONFIGS, REFUSED

SLIME_EXAMPLES = Path(__file__).resolve().parents[1] / "slime_examples"
PLUGIN_FOLDERS = ("retool", "search_r1")  # slime's launch scripts put the example's folder on PYTHONPATH
PLUGIN_MODULES = ("generate_with_retool", "generate_with_search", "examples.train_infer_mismatch_helper",
                  "examples.multi_agent", "examples.geo3k_vlm_multi_turn",
                  "tests.slime_compat")  # the last: the eval_function case's function, the figure environment
SEARCH_URL = "http://127.0.0.1:8000/retrieve"  # Search-R1's SEARCH_R1_CONFIGS["local"]["search_url"]


def family(argv: list[str]) -> str:
    """The script's model family: its --hf-checkpoint's model_type."""
    return HF_CONFIGS[Path(argv[argv.index("--hf-checkpoint") + 1]).name]["model_type"]


# The dense scripts (tests/data/slime_launch_scripts.json) that run here, by family, and why each other one does not
DENSE_RUNS = {"run-qwen3-4B.sh": "qwen3", "run-qwen3-4B-amd.sh": "qwen3", "run-qwen3-32B.sh": "qwen3",
              "run-qwen2.5-0.5B-gb10-smoke.sh": "qwen2", "run-qwen2.5-0.5B-reproducibility.sh": "qwen2",
              "run-mimo-7B-rl-eagle.sh": "mimo", "run-glm4-9B.sh": "glm4"}
DENSE_LEFT_OUT = {
    "run_qwen2.5_3B.sh": "search-r1's script: the search_r1 example",
    "retool_qwen3_4b_rl.sh": "retool's script: the retool example",
    "run-qwen3.5-27B.sh": "Qwen3.5, which fully_async_qwen3.5_9B runs on megatron: left out for the cost of one more "
                          "job",
    "run-qwen3-4B-base-sft.sh": "the sft_qwen3_4B_base example (tests/slime_examples/launch_args.json)",
    "run-qwen3-4b-fp8.sh": "refused at submit: its FP8 checkpoint (a quantization_config in config.json)",
}
# Refused on megatron for their family, whose refusal names fsdp: they run moved to it, as docs/slime.md's porting
# section says (`--train-backend fsdp` appended, then the flags its refusal names as Megatron settings dropped)
ON_FSDP: dict[str, str] = {}  # none left: megatron builds every example's family
# examples with images: their stack serves a tiny vision-language model of the family
MULTI_TURN = "geo3k_vlm_multi_turn_qwen3.5_35B_A3B"  # slime's multi-turn VLM example, on the geo3k stack
# and its rollout.py again, with an environment whose observations carry images (check_figures)
FIGURES = "geo3k_vlm_multi_turn_qwen3.5_35B_A3B_with_figures"
VISION_STACKS = {"geo3k_vlm_qwen3.5_35B_A3B": "qwen3_5_moe_vl", MULTI_TURN: "qwen3_5_moe_vl"}
RUNS = {FIGURES: (EXAMPLES[MULTI_TURN]["argv"], VISION_STACKS[MULTI_TURN]),
        **{name: (EXAMPLES[name]["argv"], VISION_STACKS.get(name, family(EXAMPLES[name]["argv"])))
           for name in EXAMPLES if name not in REFUSED},
        **{name: (DENSE[name], model_type) for name, model_type in DENSE_RUNS.items()},
        **{name: (EXAMPLES[name]["argv"], model_type) for name, model_type in ON_FSDP.items()}}
MEGATRON_ONLY = re.compile(r"slime_args: (.*): Megatron settings, which train_backend fsdp does not take; drop them")


def job_id(name: str) -> str:
    return "slime-" + name.lower().replace("_", "-").replace(".", "-")


@pytest.fixture(scope="module")
def search_server():
    """Search-R1's retrieval server format: {"queries", "topk"} -> {"result": [[{"contents": ...}] * topk]}."""
    server = JsonServer(lambda path, body: (200, {"result": [[
        {"contents": '"France"\nParis is the capital of France.'}] * body["topk"]]}))
    yield server
    server.close()


@pytest.fixture(scope="module")
def plugin_path(search_server, tmp_path_factory) -> str:
    """The examples' folders as a user deploys them: search-r1's with its search_url set to the local server."""
    root = tmp_path_factory.mktemp("slime-plugins")
    for folder in PLUGIN_FOLDERS:
        shutil.copytree(SLIME_EXAMPLES / folder, root / folder)
    search = root / "search_r1" / "generate_with_search.py"
    search.write_text(search.read_text().replace(SEARCH_URL, f"{search_server.url}/retrieve"))
    shutil.copytree(SLIME_EXAMPLES / "examples", root / "examples")  # slime's root: examples.* (a namespace package)
    return os.pathsep.join([*(str(root / folder) for folder in PLUGIN_FOLDERS), str(root)])


@pytest.fixture(scope="module")
def stack_of(session_dir, plugin_path):
    """family -> (its stack's state, its tiny model): started on first use, one at a time (the last one stops when
    another family's starts; the scripts run grouped by family)."""
    up: dict[str, tuple[Path, dict, Path]] = {}

    def get(model_type: str) -> tuple[dict, Path]:
        if model_type not in up:
            for work_dir, _, _ in up.values():
                stack.down(work_dir)
            up.clear()
            model = build_tiny_model(session_dir / f"slime-tiny-{model_type}", model_type)
            work_dir = session_dir / f"slime-examples-{model_type}"
            allowed = ",".join([os.environ.get(ALLOWLIST_ENV, ""), *PLUGIN_MODULES])
            (work_dir / "wandb").mkdir(parents=True, exist_ok=True)
            with pytest.MonkeyPatch.context() as env:  # what the stack's processes inherit
                env.setenv("PYTHONPATH", os.pathsep.join([plugin_path, os.environ.get("PYTHONPATH", "")]))
                env.setenv("WANDB_MODE", "offline")  # the scripts' --use-wandb: W&B's own local stand-in
                env.setenv("WANDB_DIR", str(work_dir / "wandb"))
                state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=model, num_engines=1,
                                                    trainer_threads=1, plugin_allowlist=allowed,
                                                    path_roots=stack_roots(session_dir)))
            up[model_type] = (work_dir, state, model)
        _, state, model = up[model_type]
        return state, model

    yield get
    for work_dir, _, _ in up.values():
        stack.down(work_dir)


def serving_engine(state: dict, timeout_s: float = 180.0) -> str:
    """The stack's engine, once its rollout manager lists it (slime's OPD teacher at --rm-url)."""
    deadline = time.monotonic() + timeout_s
    while not (urls := engine_urls(state)):
        assert time.monotonic() < deadline, f"no engine joined the pool in {timeout_s} s"
        time.sleep(0.5)
    return urls[0]


def test_every_dense_script_runs_here_or_is_left_out_for_a_reason():
    assert sorted(DENSE) == sorted([*DENSE_RUNS, *DENSE_LEFT_OUT])


def moved_to_fsdp(state: dict, argv: list[str], job: str) -> list[str]:
    """What a slime user does when megatron refuses the model's family: append `--train-backend fsdp`, submit, drop
    the flags the refusal names."""
    argv = [*argv, "--train-backend", "fsdp"]
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client, pytest.raises(InvalidArgument) as err:
        client.submit({"slime_args": argv, "job_id": job})
    named = MEGATRON_ONLY.search(str(err.value))
    assert named, err.value
    drop = {flag.removeprefix("--") for flag in named.group(1).split(", ")}
    return [token for flag, values in split_flags(argv) if flag not in drop for token in (f"--{flag}", *values)]


# its own stack (a vision-language model, about two minutes): left out of make test-fast
SLOW = {"geo3k_vlm_qwen3.5_35B_A3B", MULTI_TURN, FIGURES}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                  for name in sorted(RUNS, key=lambda name: (RUNS[name][1], name))])  # by stack
def test_each_accepted_script_runs_two_rollouts_on_a_tiny_model_of_its_family(name, stack_of, tmp_path):
    script_argv, model_type = RUNS[name]
    state, model = stack_of(model_type)
    teacher = f"{serving_engine(state)}/generate"
    argv = tiny_argv(script_argv, model_dir=model, work_dir=tmp_path, rm_url=teacher)
    if "--custom-config-path" in argv:  # relative to slime's root, which tests/slime_examples mirrors
        at = argv.index("--custom-config-path") + 1
        argv[at] = str(SLIME_EXAMPLES / argv[at])
    if name in (MULTI_TURN, FIGURES):
        argv += short_turns(model)
    if name == FIGURES:  # its YAML names the figure environment (tests/slime_compat/figure_env.py)
        config = tmp_path / "figures.yaml"
        config.write_text(yaml.safe_dump({"max_turns": 3,
                                          "rollout_interaction_env_path": "tests.slime_compat.figure_env"}))
        argv[argv.index("--custom-config-path") + 1] = str(config)
    if name in ON_FSDP:
        argv = moved_to_fsdp(state, argv, job_id(name))
    spec = {"slime_args": argv, "job_id": job_id(name), "weight_sync_timeout_s": 60.0,
            "lease_timeout_s": 120.0, "rollout_timeout_s": 300.0}
    job, events = run(state, spec, timeout_s=400)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2, [e["message"] for e in events]
    assert all(m["rollout/reward_failed_ratio"] == 0.0 for m in steps)  # the examples' reward functions ran clean
    converted = job["spec"]
    assert converted["train_backend"] == ("fsdp" if name in ON_FSDP else "megatron")
    assert converted["hf_checkpoint"] == str(model)
    if "--use-wandb" in argv:  # a W&B run of the job's (offline: no W&B server here)
        runs = Path(state["work_dir"], "wandb", "wandb").glob("offline-run-*/run-*.wandb")
        assert any(spec["job_id"].encode() in run.read_bytes() for run in runs)
    CHECKS.get(name, lambda *_: None)(converted, steps, state)


def check_fully_async(spec: dict, steps: list[dict], state: dict) -> None:
    assert spec["mode"] == "fully_async"  # slime's generate_rollout_fully_async


def check_retool(spec: dict, steps: list[dict], state: dict) -> None:
    # retool's reward: no \boxed{} answer (the tiny tokenizer has no backslash) and no tool call: -1 - 0.1
    assert [m["rollout/reward_mean"] for m in steps] == pytest.approx([-1.1, -1.1])
    assert "eval/aime" in steps[-1] and "eval/aime-pass@2" in steps[-1]  # its eval set, after the last rollout


def buffer_samples(state: dict, spec: dict) -> list:
    """Rollout 0's samples, as the buffer holds them."""
    with BufferClient(state["buffer_addr"], timeout_s=30.0) as buffer:
        groups = buffer.get_batch(spec["job_id"], 0, spec["rollout_batch_size"], timeout_s=5)
    return [sample for group in groups for sample in group.samples]


def check_search_r1(spec: dict, steps: list[dict], state: dict) -> None:
    labels = [s.label for s in buffer_samples(state, spec)]
    assert labels and all(label["ground_truth"]["target"] in (["3"], ["4"]) for label in labels)


def check_eval_multi_task(spec: dict, steps: list[dict], state: dict) -> None:
    last = steps[-1]  # each dataset its own samples per prompt (multi_task.yaml): pass@4 for aime, pass@2 for gpqa
    assert "eval/aime-pass@4" in last and "eval/gpqa-pass@2" in last and "eval/gpqa-pass@4" not in last


def check_eval_function(spec: dict, steps: list[dict], state: dict) -> None:
    """--eval-function-path: the user's function ran each eval (its own metric), delegating to slime's default eval
    of the eval config's datasets, each with its own samples per prompt."""
    check_eval_multi_task(spec, steps, state)
    assert steps[-1]["eval/by_eval_function"] == 2.0


def check_opd(spec: dict, steps: list[dict], state: dict) -> None:
    """The teacher holds the student's own first weights (sglang: the stack's engine; megatron: opd_teacher_load
    names the tiny model), so its log-probs of the student's sampled tokens are the student's: the first step's
    reverse KL is 0 up to float noise (tests/e2e/test_distillation.py has a student learn from a real teacher)."""
    assert abs(steps[0]["train/opd_reverse_kl"]) < 1e-3
    if spec["opd_type"] == "megatron":  # the teacher model in the trainer, and a real reward (--rm-type math)
        assert not spec["opd_only"] and spec["rm_type"] == "math"
        return
    # slime's OPD reward function and post-process: the teacher's log-probs of each response token, reward 0
    assert spec["opd_only"] and all(m["rollout/reward_mean"] == 0.0 for m in steps)
    for sample in buffer_samples(state, spec):
        assert sample.teacher_log_probs == pytest.approx(sample.rollout_log_probs, abs=1e-4)
        assert len(sample.teacher_log_probs) == sample.response_length > 0


def check_mismatch_helper(spec: dict, steps: list[dict], state: dict) -> None:
    """slime's mis.py ran as the job's TIS function (its mis.yaml's settings in slime's args): its metrics, per step."""
    assert spec["custom_tis_function_path"] == "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
    assert spec["use_tis"] and {**spec, **spec["plugin_args"]}["tis_mode"] == "truncate"
    assert all(any("is_ratio_mean_final" in key for key in m) for m in steps), sorted(steps[0])


def check_multi_agent(spec: dict, steps: list[dict], state: dict) -> None:
    """slime's multi-agent system ran as the generate function: its solvers' (and rewriters') samples, a fan-out of
    several per prompt, trained."""
    assert spec["custom_generate_function_path"] == \
        "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"
    assert len(buffer_samples(state, spec)) > spec["rollout_batch_size"]


def check_mtp(spec: dict, steps: list[dict], state: dict) -> None:
    """run-mimo-7B-rl-eagle.sh and run-glm4.7-30B-A3B.sh trained the checkpoint's MTP layer (the tiny MiMo and
    GLM-4.7-Flash carry one) beside the policy: its loss, per step."""
    assert spec["mtp_num_layers"] == 1 and spec["enable_mtp_training"] and spec["mtp_loss_scaling_factor"] == 0.2
    assert all(m["train/mtp_loss"] > 0 and m["train/mtp_1_loss"] == m["train/mtp_loss"] for m in steps)


def check_engine_log_probs(spec: dict, steps: list[dict], state: dict) -> None:
    """The multi-latent-attention MoE scripts on megatron: the engine's log-prob of each sampled token reached the
    trainer and is the trainer's own (megatron-core's multi-latent attention and MoE against transformers' in the
    engine) up to float32 rounding, every step: not missing, not the trainer's compared with itself (exactly 0), not
    another model's."""
    diffs = [m["train/train_rollout_logprob_abs_diff"] for m in steps]
    assert all(0.0 < diff < 1e-4 for diff in diffs), diffs


def check_glm47_flash(spec: dict, steps: list[dict], state: dict) -> None:
    """GLM-4.7-Flash's script: its MTP layer trained, and the engine's log-probs as for DeepSeek-V3's scripts."""
    check_mtp(spec, steps, state)
    check_engine_log_probs(spec, steps, state)


def short_turns(model: Path) -> list[str]:
    """slime's geo3k_vlm_multi_turn rollout gives each turn the whole budget left (rollout_max_context_len, else
    max_new_tokens, less the context so far): the context is the tiny model's and each turn ends at its first
    printable character (rollout_stop_token_ids), so an untrained model's turns stay a token or two long."""
    encoder = PromptEncoder(model)
    stops = sorted({i for char in string.printable.strip() for i in encoder.encode_text(char)})
    return ["--rollout-max-context-len", str(encoder.context_len), "--rollout-stop-token-ids", *map(str, stops)]


def check_multi_turn(spec: dict, steps: list[dict], state: dict) -> None:
    """slime's geo3k_vlm_multi_turn rollout.py and env_geo3k.py ran as they are: the tiny model calls no tool, so
    geo3k's environment ends each episode after the first turn, trained as it was generated (check_figures gives
    the rollout an environment whose observations carry images)."""
    assert spec["custom_generate_function_path"] == "examples.geo3k_vlm_multi_turn.rollout.generate"
    assert {**spec, **spec["plugin_args"]}["rollout_interaction_env_path"] == "examples.geo3k_vlm_multi_turn.env_geo3k"
    samples = buffer_samples(state, spec)
    assert samples and all(s.response_length > 0 and s.loss_mask == [1] * s.response_length for s in samples)
    assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-3 for m in steps)


def check_figures(spec: dict, steps: list[dict], state: dict) -> None:
    """slime's geo3k_vlm_multi_turn rollout.py (unchanged) with an environment whose every observation shows a new
    image (tests/slime_compat/figure_env.py, on slime's BaseInteractionEnv): each observation's tokens, its image's
    among them, get loss_mask 0 and log-prob 0; the sample carries the images its turns added after its prompt's;
    and the trainer, reading each observation image where the engine did, recomputes the engine's log-probs of the
    tokens generated after it."""
    image_token = json.loads((Path(spec["hf_checkpoint"]) / "config.json").read_text())["image_token_id"]
    samples = buffer_samples(state, spec)
    assert len(samples) == 4
    for sample in samples:
        response = sample.tokens[len(sample.tokens) - sample.response_length:]
        observed = [i for i, token in enumerate(response) if token == image_token]
        # three turns: two observations between them, each with its figure (28x56 and 56x56) as qwen_vl_utils resized
        # it for the processor (multiples of 28, at least 4 x 28 x 28 pixels): what the engine was sent
        assert len(sample.observation_images) == 2, (sample.status, sample.response)
        assert [(image.width, image.height) for image in sample.observation_images] == [(56, 84), (56, 56)]
        assert observed and all(sample.loss_mask[i] == 0 and sample.rollout_log_probs[i] == 0.0 for i in observed)
        assert "figure 1" in sample.response and "figure 2" in sample.response
        assert 0 < sum(sample.loss_mask) < sample.response_length  # the model's own tokens are trained
    diffs = [m["train/train_rollout_logprob_abs_diff"] for m in steps]
    print(f"multi-turn with figures: train_rollout_logprob_abs_diff {', '.join(f'{d:.2e}' for d in diffs)}")
    assert all(diff < 1e-3 for diff in diffs)


CHECKS = {"fully_async_qwen2.5_0.5B": check_fully_async, "fully_async_qwen3.5_9B": check_fully_async,
          MULTI_TURN: check_multi_turn, FIGURES: check_figures,
          "run-mimo-7B-rl-eagle.sh": check_mtp, "glm4.7_30B_A3B": check_glm47_flash,
          "retool": check_retool, "search_r1": check_search_r1, "eval_multi_task": check_eval_multi_task,
          "eval_function": check_eval_function,
          "on_policy_distillation_sglang": check_opd, "on_policy_distillation_megatron": check_opd,
          "train_infer_mismatch_helper": check_mismatch_helper, "multi_agent": check_multi_agent,
          "deepseek_r1": check_engine_log_probs, "moonlight_16B_A3B": check_engine_log_probs}

