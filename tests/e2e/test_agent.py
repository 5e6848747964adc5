"""End to end: the calculator agent example (examples/agent: the openai client with a calculator tool) trains for
two rollouts from a submitted job, through a local stack whose engines serve a tiny tool-calling model; the samples
in the buffer are the gateway sessions' tokens, tool results masked out of the loss. The dashboard, in a real
Chromium, shows an agent's session as the agent saw it: a parallel tool call, its results, a spawned sub-agent."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from examples.agent.model import build_agent_model
from physarum import stack
from services.buffer.client import BufferClient
from services.trainer.driver.sample_board import mask_runs
from tests.e2e.roots import stack_roots
from tests.e2e.test_dashboard import ARTIFACTS, _chromium_missing, browser, console_errors, wait_for  # noqa: F401
from tests.e2e.test_loop import run
from tests.integration.gateway_fixtures import CALCULATOR_CONVERSATION, PARALLEL, PARALLEL_CONVERSATION, QUESTION

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent"


@pytest.fixture(scope="module")
def agent_stack(session_dir):
    """A stack of its own: its engines serve the tool-calling model (the shared stack's model has no tools
    template), taught one calculator call and two calls in one turn."""
    model = build_agent_model(session_dir / "agent-e2e-model", conversations=[CALCULATOR_CONVERSATION,
                                                                            PARALLEL_CONVERSATION], warmup_steps=400)
    work_dir = session_dir / "agent-stack"
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=model, num_engines=1, trainer_threads=1,
                                        path_roots=stack_roots(session_dir)))
    yield state, model
    stack.down(work_dir)


def test_calculator_agent_trains_from_a_submitted_job(agent_stack, tmp_path):
    state, model = agent_stack
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"input": QUESTION, "label": "5"}) + "\n" for _ in range(8)))
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec.update(job_id="e2e-agent", hf_checkpoint=str(model), prompt_data=str(train), num_rollout=2,
                rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4, eval_prompt_data=[],
                rollout_temperature=0.5,  # the warmed-up answer is likely at 1.0 and all but certain at 0.5
                weight_sync_timeout_s=60.0, lease_timeout_s=120.0, rollout_timeout_s=400.0, reward_timeout_s=60.0)
    spec.pop("eval_interval")
    job, events = run(state, spec, timeout_s=600.0)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # the engines had the trainer's weights: the trainer's log-probs of the sessions' tokens are the engines'
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    with BufferClient(state["buffer_addr"], timeout_s=30.0) as buffer:
        samples = [s for r in range(2) for g in buffer.get_batch(spec["job_id"], r, 2, timeout_s=5) for s in g.samples]
    assert len(samples) == 8
    for sample in samples:
        turns = sample.metadata["agent_turns"]
        assert turns >= 1 and sample.metadata["agent_branches"] == []
        assert (0 in sample.loss_mask) == (turns > 1)  # a tool result between turns trains nothing
        assert sample.loss_mask[-1] == 1 and len(sample.rollout_log_probs) == sample.response_length
    assert any(sample.reward == 1.0 for sample in samples)


def session_cards(driver) -> list[dict] | None:
    """Each opened session on the page as the dashboard draws it, read in one script."""
    return driver.execute_script("""
        const sessions = [...document.querySelectorAll("#samples .agent-session")];
        if (!sessions.length) return null;
        return sessions.map((s) => ({
          session: s.dataset.session, links: [...s.querySelectorAll(".meta .spawn")].map((e) => e.textContent),
          turns: [...s.querySelectorAll(".agent-turn")].map((t) => ({
            index: Number(t.dataset.turn), trained: t.dataset.trained === "true",
            head: t.querySelector(".agent-turn-head").textContent,
            sent: [...t.querySelectorAll(".msg.sent")].map(
              (m) => [m.dataset.role, m.querySelector(".text")?.textContent]),
            calls: [...t.querySelectorAll(".msg.reply .tool-call")].map((c) => c.lastChild.textContent),
            reply: t.querySelector(".msg.reply .text")?.textContent ?? ""}))}));""")


@pytest.mark.skipif(bool(_chromium_missing()), reason=_chromium_missing() or "-")
def test_the_dashboard_shows_an_agent_session_as_the_agent_saw_it(agent_stack, browser, tmp_path):  # noqa: F811
    """The calculator agent asks for two sums; the model calls the calculator twice in one turn; the agent sends both
    results back in one request and gets the answer, then spawns a sub-agent (tests.plugins.agent_fns.spawning_agent).
    The dashboard opens each sample's session: the two calls, the two results, the answer, which turns are trained
    (equal to the sample's loss_mask), the spawned session and the one it was spawned from."""
    from selenium.webdriver.common.by import By

    state, _ = agent_stack
    url = state["trainer_url"]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"input": PARALLEL, "label": "5 and 20."}) + "\n" for _ in range(2)))
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec.update(job_id="e2e-agent-dashboard", hf_checkpoint=str(agent_stack[1]), prompt_data=str(train),
                num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2, global_batch_size=2, eval_prompt_data=[],
                rollout_temperature=0.1, rollout_max_response_len=600,  # all but greedy
                agent_function_path="tests.plugins.agent_fns.spawning_agent", weight_sync_timeout_s=60.0,
                lease_timeout_s=120.0, rollout_timeout_s=400.0, reward_timeout_s=60.0)
    spec.pop("eval_interval")
    job, _ = run(state, spec, timeout_s=600.0)
    assert job["state"] == "SUCCEEDED", job["error"]
    with BufferClient(state["buffer_addr"], timeout_s=30.0) as buffer:
        (group,) = buffer.get_batch(spec["job_id"], 0, 1, timeout_s=5)
    root = group.samples[0]
    record = httpx.get(f"{url}/v1/dashboard/jobs/e2e-agent-dashboard/samples", timeout=30).json()
    assert [s["has_session"] for s in record["samples"]] == [True] * 4
    served = httpx.get(f"{url}/v1/dashboard/jobs/e2e-agent-dashboard/samples/0/session",
                       params={"rollout_id": record["rollout_id"]}, timeout=30).json()
    # the trained turns' token counts are the sample's loss_mask runs: generated 1, the tool results between 0
    trained = [t for t in served["turns"] if t["trained"]]
    runs = [(end - start, masked) for start, end, masked in mask_runs(root.loss_mask)]
    assert runs == [(trained[0]["generated_tokens"], False), (trained[1]["context_tokens"], True),
                    (trained[1]["generated_tokens"], False)], (runs, served)

    browser.get(url + "/dashboard/")
    wait_for("the sign-in form", lambda: browser.find_element(By.ID, "login-none").is_displayed())
    browser.find_element(By.ID, "login-none").click()  # this stack runs without tokens
    browser.get(url + "/dashboard/#/job/e2e-agent-dashboard")
    summaries = wait_for("the samples' sessions", lambda: len(found := browser.find_elements(
        By.CSS_SELECTOR, "#samples details.session summary")) == 4 and found)
    for summary in summaries[:2]:  # the first prompt's session and the sub-agent it spawned
        summary.click()
    cards = wait_for("two sessions drawn", lambda: (found := session_cards(browser)) and len(found) == 2 and found)
    agent, sub = cards
    first, second = agent["turns"]
    assert first["sent"] == [["user", PARALLEL]] and first["trained"] and second["trained"], agent
    assert first["calls"] == ['calculator({"expression": "2+3"})', 'calculator({"expression": "4*5"})'], first
    assert [role for role, _ in second["sent"]] == ["tool", "tool"] and [t for _, t in second["sent"]] == ["5", "20"]
    assert second["reply"] == "5 and 20." and "continues turn 0" in second["head"], second
    assert first["head"].startswith("turn 0 · starts the session"), first
    assert agent["links"] == [f"spawned sessions {sub['session']} (a sample each)"], agent
    assert sub["links"] == [f"spawned from session {agent['session']}"] and sub["session"].startswith(agent["session"])
    assert [t["trained"] for t in sub["turns"]] == [True] and sub["turns"][0]["sent"] == [["user", PARALLEL]], sub
    browser.execute_script('document.querySelector("#samples details.session").scrollIntoView()')
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-agent-session.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")
    errors = console_errors(browser)
    assert not errors, errors
