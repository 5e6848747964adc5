"""slime's own example plugins (search-r1, retool), copied unmodified under tests/slime_examples, run two rollouts
of a job each: the
rollout manager calls their generate function, the Reward service their reward function, both through the `slime`
compatibility package. The engine is scripted (SGLang's /generate format), so what the model "says" is known.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import string

import pytest
from tokenizers import Tokenizer

from services.common import plugins, procs
from services.common.grpc_client import wait_for_health
from tests.integration.slime_fixtures import (
    EXAMPLES,
    JsonServer,
    engine_reply,
    on_sys_path,
    reward_service,
    run_job_rollouts,
)

QUESTION = ("Answer the question. Search with <search> query </search>; answer with <answer> Beijing </answer>. "
            "Question: what is the capital of France?")


@pytest.fixture(autouse=True)
def allow_the_examples_modules(monkeypatch):
    """slime's examples are top-level modules on sys.path: the operator allows them by name."""
    allowed = os.environ.get(plugins.ALLOWLIST_ENV, "")
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, f"{allowed},generate_with_search,generate_with_retool")


@pytest.fixture(scope="module")
def buffer_addr(redis_url, tmp_path_factory):
    work = tmp_path_factory.mktemp("slime-plugins")
    port = procs.free_port()
    argv = procs.python_module("services.buffer", "--host", procs.HOST, "--port", str(port), "--redis-url", redis_url)
    proc = procs.ManagedProcess("buffer", argv, work / "buffer.log").start()
    try:
        wait_for_health(f"{procs.HOST}:{port}", timeout_s=60)
        yield f"{procs.HOST}:{port}"
    finally:
        proc.stop()


@pytest.fixture
def search_server():
    """Search-R1's retrieval server format: {"queries", "topk"} -> {"result": [[{"contents": ...}]]}."""
    server = JsonServer(lambda path, body: (200, {"result": [[
        {"contents": '"France"\nParis is the capital of France.'}] * body["topk"]]}))
    yield server
    server.close()


def test_search_r1_generate_and_reward_run_two_rollouts(buffer_addr, search_server, tiny_model_dir, tmp_path):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    answers = itertools.cycle(["Paris", "Lyon"])

    def engine(path: str, body: dict) -> tuple[int, dict]:
        """Turn 1 searches; turn 2 (the prompt now holds the search result) answers, alternately right and wrong."""
        if "<information>" not in body["text"]:
            return 200, engine_reply(tokenizer, "<think>look it up</think><search>capital of France</search>")
        return 200, engine_reply(tokenizer, f"<think>found it</think><answer>{next(answers)}</answer>")

    router = JsonServer(engine)
    data = tmp_path / "nq.jsonl"
    data.write_text("".join(json.dumps({"prompt": QUESTION, "reward_model": {
        "ground_truth": {"target": ["Paris"]}, "style": "rule"}}) + "\n" for _ in range(4)))
    spec = {"job_id": "search-r1", "hf_checkpoint": str(tiny_model_dir), "prompt_data": str(data),
            "input_key": "prompt", "label_key": "reward_model", "apply_chat_template": True, "num_rollout": 2,
            "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 64,
            "custom_generate_function_path": "generate_with_search.generate",
            "custom_rm_path": "generate_with_search.reward_func", "rm_type": ""}
    try:
        with on_sys_path(EXAMPLES / "search_r1"), reward_service() as reward_addr:
            plugins.ensure_slime_compat()  # what the services do before loading a plugin
            plugin = importlib.import_module("generate_with_search")
            plugin.SEARCH_R1_CONFIGS["local"]["search_url"] = f"{search_server.url}/retrieve"  # its config dict
            rollouts = run_job_rollouts(spec, buffer_addr=buffer_addr, reward_addr=reward_addr,
                                        router_url=router.url, num_rollouts=2)
    finally:
        router.close()

    assert [len(groups) for groups in rollouts] == [2, 2]
    samples = [s for groups in rollouts for g in groups for s in g.samples]
    assert len(samples) == 8
    for sample in samples:
        assert sample.label == {"ground_truth": {"target": ["Paris"]}, "style": "rule"}  # the label's JSON type
        assert sample.response.startswith("<think>look it up</think><search>capital of France</search>")
        assert "<information>Doc 1(Title: \"France\") Paris is the capital of France." in sample.response
        # model turns train (log-prob -0.5 from the engine); the search result's tokens do not (log-prob 0)
        info = [m == 0 for m in sample.loss_mask]
        assert any(info) and not all(info) and len(sample.loss_mask) == sample.response_length
        assert all((lp == 0.0) == masked for lp, masked in zip(sample.rollout_log_probs, info, strict=True))
        assert sample.reward == (1.0 if sample.response.endswith("<answer>Paris</answer>") else 0.0)
        assert sample.reward_error == ""
    assert sorted(s.reward for s in samples) == [0.0] * 4 + [1.0] * 4
    searches = search_server.posts("/retrieve")
    assert len(searches) == 8 and all(b == {"queries": ["capital of France"], "topk": 3, "return_scores": False}
                                      for b in searches)
    turns = router.posts("/generate")
    assert len(turns) == 16 and all("</search>" in b["sampling_params"]["stop"] for b in turns)


@pytest.fixture(scope="module")
def printable_model(tmp_path_factory):
    """A character-level tokenizer over printable ASCII (the tiny model's knows only its task's characters, and
    retool decodes the engine's tokens back to text)."""
    from physarum.tinymodel import build_tokenizer

    out = tmp_path_factory.mktemp("printable-model")
    build_tokenizer([string.printable], out)
    return out


def test_retool_generate_and_reward_run_two_rollouts(buffer_addr, printable_model, tmp_path):
    tokenizer = Tokenizer.from_file(str(printable_model / "tokenizer.json"))
    answers = itertools.cycle(["5", "6"])

    def engine(path: str, body: dict) -> tuple[int, dict]:
        """Turn 1 runs code; turn 2 (the interpreter's output is in the context) answers, right or wrong."""
        context = tokenizer.decode(body["input_ids"], skip_special_tokens=False)
        if "<interpreter>" not in context:
            return 200, engine_reply(tokenizer, "Let me compute. <code>print(2+3)</code>")
        return 200, engine_reply(tokenizer, f"So the result is Answer: \\boxed{{{next(answers)}}}")

    router = JsonServer(engine)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": "What is 2+3?", "label": "5"}) + "\n" for _ in range(4)))
    spec = {"job_id": "retool", "hf_checkpoint": str(printable_model), "prompt_data": str(data),
            "input_key": "prompt", "label_key": "label", "apply_chat_template": True, "reward_key": "score",
            "num_rollout": 2, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 64,
            "max_tokens_per_gpu": 4096, "use_dynamic_batch_size": True,
            "custom_generate_function_path": "generate_with_retool.generate",
            "custom_rm_path": "generate_with_retool.reward_func"}
    try:
        with on_sys_path(EXAMPLES / "retool"), reward_service() as reward_addr:
            rollouts = run_job_rollouts(spec, buffer_addr=buffer_addr, reward_addr=reward_addr,
                                        router_url=router.url, num_rollouts=2)
    finally:
        router.close()

    samples = [s for groups in rollouts for g in groups for s in g.samples]
    assert len(samples) == 8
    for sample in samples:
        assert "<interpreter>\nOutput:\n5\n</interpreter>" in sample.response  # the sandbox ran the model's code
        assert sample.metadata["slime_sample_attrs"]["tool_call_count"] == 1
        right = sample.response.endswith("\\boxed{5}")
        # wrong: -1 plus retool's tool bonus (1 call - 2) / 2 × 0.1, which needs tool_call_count at the reward
        assert sample.reward == pytest.approx(1.0 if right else -1.05)
        assert sample.reward_scores["score"] == sample.reward and sample.reward_error == ""
        info = [m == 0 for m in sample.loss_mask]
        assert any(info) and not all(info)
    assert sorted(s.reward > 0 for s in samples) == [False] * 4 + [True] * 4


def test_search_r1_launch_args_as_pasted_run_two_rollouts(buffer_addr, search_server, tiny_model_dir, tmp_path):
    """slime's run_qwen2.5_3B.sh argv (tests/slime_examples/launch_args.json) without its model block (the tiny
    model's own), its files here and sizes for a CPU appended: the last value of a flag wins, as in slime."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from services.trainer.slime_flags.megatron_flags import ARCH

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    answers = itertools.cycle(["Paris", "Lyon"])

    def engine(path: str, body: dict) -> tuple[int, dict]:
        if "<information>" not in body["text"]:
            return 200, engine_reply(tokenizer, "<search>capital of France</search>")
        return 200, engine_reply(tokenizer, f"<answer>{next(answers)}</answer>")

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": QUESTION, "reward_model": {
        "ground_truth": {"target": ["Paris"]}, "style": "rule"}}] * 4), data)
    pasted = json.loads((EXAMPLES / "launch_args.json").read_text())["search_r1"]["argv"]
    argv, skip = [], False
    for token in pasted:  # drop the 3B model's architecture flags and their values
        if token.startswith("--"):
            skip = token[2:] in ARCH
        if not skip:
            argv.append(token)
    argv += ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "64",
             "--num-rollout", "2"]
    router = JsonServer(engine)
    try:
        with on_sys_path(EXAMPLES / "search_r1"), reward_service() as reward_addr:
            plugins.ensure_slime_compat()
            plugin = importlib.import_module("generate_with_search")
            plugin.SEARCH_R1_CONFIGS["local"]["search_url"] = f"{search_server.url}/retrieve"
            rollouts = run_job_rollouts({"slime_args": argv, "job_id": "search-r1-pasted"}, buffer_addr=buffer_addr,
                                        reward_addr=reward_addr, router_url=router.url, num_rollouts=2)
    finally:
        router.close()
    samples = [s for groups in rollouts for g in groups for s in g.samples]
    assert [len(groups) for groups in rollouts] == [2, 2] and len(samples) == 8
    assert sorted(s.reward for s in samples) == [0.0] * 4 + [1.0] * 4  # its exact-match reward on the parquet label
    assert all(s.label == {"ground_truth": {"target": ["Paris"]}, "style": "rule"} for s in samples)
