"""The dashboard in a real headless Chromium (Debian's, driven by selenium through chromedriver), against a local
stack of its own (`physarum up` with authentication on) running short jobs: sign in, the job, its curves gaining
points, a sample's text and reward, a multi-turn sample turn by turn, the pool and scaling it, cancel; a screenshot
is kept under the test run's artifacts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from physarum import stack
from services.common import auth
from tests.e2e.test_loop import job_spec

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PHYSARUM_TEST_ARTIFACTS", ROOT / ".physarum" / "test-artifacts"))
WAIT_S = 240.0  # a rollout on a loaded 2-core machine takes seconds; this bounds every wait


def _chromium_missing() -> str:
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        return f"no Chromium or chromedriver ({CHROMIUM}, {CHROMEDRIVER}): .ci/run installs Debian's chromium and " \
               "chromium-driver; on this machine they could not be installed"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pyproject's dev extra pins it)"
    return ""


pytestmark = pytest.mark.skipif(bool(_chromium_missing()), reason=_chromium_missing() or "-")


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory):
    """`physarum up` as a newcomer runs it: no --model (the demo's model is built), authentication on; its output
    names the dashboard and the token to paste."""
    home = tmp_path_factory.mktemp("dashboard-home")  # the demo's model is built under the working directory
    work_dir = home / "stack"
    try:
        # the stack's processes run in `home` too: the repository on their path finds the example plugins
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        # roots: this pytest run's private base directory (the tests' files) and the repository (the examples')
        roots = [arg for root in (home.parent, ROOT) for arg in ("--root", str(root))]
        done = subprocess.run([sys.executable, "-m", "physarum", "--work-dir", str(work_dir), "up", "--engines", "1",
                               *roots], cwd=home, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        state = stack.read_state(work_dir)
        match = re.search(r"dashboard: (http://\S+)/dashboard/  token: (\S+)", done.stdout)
        assert match and match.group(1) == state["trainer_url"], done.stdout
        token = match.group(2)
        assert token == auth.read_token("trainer", stack.operator_token_dir(work_dir))
        yield state, token, home / ".physarum" / "demo"
    finally:
        stack.down(work_dir)


@pytest.fixture()
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1800"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(what: str, check, timeout_s: float = WAIT_S, interval_s: float = 0.5):
    """Poll `check` until it returns a truthy value; fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception:  # noqa: BLE001 - an element not there yet, or replaced mid-read by a refresh
            value = None
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def sign_in(browser, url: str, token: str) -> None:
    """Open the dashboard and paste the token into its sign-in form, as a newcomer does."""
    from selenium.webdriver.common.by import By

    browser.get(url + "/dashboard/")
    wait_for("the sign-in form", lambda: browser.find_element(By.ID, "token").is_displayed())
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "login-submit").click()


def console_errors(driver) -> list[str]:
    return [f"{e['level']}: {e['message']}" for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def chart_points(driver, group: str) -> int:
    from selenium.webdriver.common.by import By

    return int(driver.find_element(By.CSS_SELECTOR, f'.chart[data-group="{group}"]').get_attribute("data-points"))


def first_sample(driver) -> dict | None:
    """The first sample card's reward, reward text, prompt text and response parts, read in one script (a refresh
    may replace the cards between separate reads)."""
    return driver.execute_script("""
        const card = document.querySelector("#samples .sample");
        if (!card) return null;
        return {reward: card.dataset.reward, rewardText: card.querySelector(".reward").textContent,
                prompt: card.querySelector(".turn.prompt").textContent.replace(/^prompt/, ""),
                meta: card.querySelector(".meta").textContent,
                responses: card.querySelectorAll(".turn.response").length};""")


def test_a_request_without_the_token_gets_401_and_the_pages_are_open(auth_stack):
    state, token, _ = auth_stack
    url = state["trainer_url"]
    for path in ("/v1/jobs", "/v1/dashboard/pool", "/v1/dashboard/jobs/any/samples"):
        assert httpx.get(url + path, timeout=30).status_code == 401, path
        assert httpx.get(url + path, headers={"authorization": "Bearer wrong"}, timeout=30).status_code == 401, path
    reply = httpx.post(url + "/v1/dashboard/pool/scale", json={"replicas": 3}, timeout=30)
    assert reply.status_code == 401
    assert httpx.get(url + "/v1/jobs", headers=auth.bearer(token), timeout=30).status_code == 200
    for replicas in (-1, 1000):  # refused before the rollout manager is asked
        reply = httpx.post(url + "/v1/dashboard/pool/scale", json={"replicas": replicas}, headers=auth.bearer(token),
                           timeout=30)
        assert reply.status_code == 400 and "replicas must be in" in reply.text, reply.text
    page = httpx.get(url + "/dashboard/", timeout=30)  # static, holds no data
    assert page.status_code == 200 and "Job API token" in page.text


def test_an_agent_samples_session_is_behind_the_token(auth_stack):
    """The endpoint the job page opens an agent sample's session from answers only with the token, and names what
    it does not hold (an unknown job; a rollout other than the latest)."""
    state, token, _ = auth_stack
    url = state["trainer_url"]
    path = "/v1/dashboard/jobs/any/samples/0/session"
    assert httpx.get(url + path, params={"rollout_id": 0}, timeout=30).status_code == 401
    reply = httpx.get(url + path, params={"rollout_id": 0}, headers=auth.bearer(token), timeout=30)
    assert reply.status_code == 404 and "any" in reply.text, reply.text


def test_dashboard_follows_a_running_job_shows_samples_and_cancels_it(auth_stack, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    state, token, demo_dir = auth_stack
    url = state["trainer_url"]
    spec = job_spec(demo_dir / "model", demo_dir / "task" / "train.jsonl", job_id="dash-job", num_rollout=40,
                    save=str(tmp_path / "checkpoints"), save_interval=1)
    with httpx.Client(base_url=url, headers=auth.bearer(token), timeout=30) as api:
        reply = api.post("/v1/jobs", json=spec)
        assert reply.status_code == 201, reply.text

        sign_in(browser, url, token)
        link = wait_for("the job in the Jobs table", lambda: browser.find_element(
            By.CSS_SELECTOR, 'tr[data-job="dash-job"] a.job-link'))
        link.click()

        # The curves gain points as rollouts finish: first one point, then more, without reloading the page.
        wait_for("the reward curve's first point", lambda: chart_points(browser, "reward") >= 1)
        first = chart_points(browser, "reward")
        wait_for("the reward curve to gain a point", lambda: chart_points(browser, "reward") > first)
        assert chart_points(browser, "loss") >= 1

        sample = wait_for("a sample", lambda: first_sample(browser))
        assert sample["rewardText"] == f"reward {float(sample['reward']):.3f}", sample
        prompt = sample["prompt"]
        assert "+" in prompt and prompt.rstrip().endswith("="), sample  # the addition task's "a+b=" prompts
        assert sample["responses"] >= 1 and "response tokens" in sample["meta"], sample

        wait_for("a checkpoint listed", lambda: "(latest)" in browser.find_element(By.ID, "checkpoints").text)
        log_text = wait_for("the job's log tail", lambda: "dash-job" in browser.find_element(By.ID, "log").text, 60)
        assert log_text
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard-job.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"dashboard screenshot: {shot}")
        # the reward filter: a range no reward falls in leaves no sample shown
        browser.find_element(By.ID, "reward-min").send_keys("5")
        wait_for("the reward filter", lambda: not browser.find_elements(By.CSS_SELECTOR, "#samples .sample"), 30)
        browser.find_element(By.ID, "reward-min").send_keys(Keys.BACKSPACE)
        wait_for("the filter's end", lambda: browser.find_elements(By.CSS_SELECTOR, "#samples .sample"), 30)

        browser.find_element(By.ID, "cancel").click()
        browser.switch_to.alert.accept()
        wait_for("the job to be cancelled", lambda: api.get("/v1/jobs/dash-job").json()["state"] == "CANCELLED")
        wait_for("the page to show CANCELLED",
                 lambda: browser.find_element(By.ID, "job-state").text == "CANCELLED", 60)

        browser.get(url + "/dashboard/#/pool")
        wait_for("the pool's engine", lambda: browser.find_elements(By.CSS_SELECTOR, "#engines tr[data-engine]"), 60)
        wait_for("the pool's join events", lambda: "join" in browser.find_element(By.ID, "pool-events").text, 60)
        wait_for("the buffer's counters", lambda: "prompts leased" in browser.find_element(By.ID, "buffer").text, 60)
        replicas = browser.find_element(By.ID, "replicas")
        replicas.clear()
        replicas.send_keys("2")
        browser.find_element(By.ID, "scale").click()
        browser.switch_to.alert.accept()  # "Scale the engine pool to 2 engines?"
        wait_for("the pool to want 2 engines", lambda: api.get("/v1/dashboard/pool").json()["desired_replicas"] == 2)
        wait_for("the page to show it", lambda: "(2 wanted)" in browser.find_element(By.ID, "pool-summary").text, 60)
    errors = console_errors(browser)
    assert not errors, errors



def test_a_multi_turn_sample_shows_turn_by_turn_with_the_tool_output_marked(auth_stack, browser, tmp_path):
    """The shipped calculator example: the model's turns and the calculator's masked answers apart; the held-out
    eval reward is drawn beside the train reward."""
    import yaml
    from selenium.webdriver.common.by import By

    from examples.multiturn.build_dataset import write_dataset

    state, token, demo_dir = auth_stack
    url = state["trainer_url"]
    train, test = write_dataset(tmp_path, num_train=40, num_test=4)
    spec = yaml.safe_load((ROOT / "examples" / "multiturn" / "job.yaml").read_text())
    spec.update(job_id="dash-multiturn", hf_checkpoint=str(demo_dir / "model"), prompt_data=str(train), num_rollout=1,
                rollout_batch_size=8, n_samples_per_prompt=8, global_batch_size=64, eval_prompt_data=[f"calc={test}"],
                eval_interval=1, n_samples_per_eval_prompt=2, weight_sync_timeout_s=30.0, lease_timeout_s=60.0,
                rollout_timeout_s=300.0)
    with httpx.Client(base_url=url, headers=auth.bearer(token), timeout=30) as api:
        reply = api.post("/v1/jobs", json=spec)
        assert reply.status_code == 201, reply.text
        sign_in(browser, url, token)
        browser.get(url + "/dashboard/#/job/dash-multiturn")
        wait_for("the job to finish", lambda: api.get("/v1/jobs/dash-multiturn").json()["state"] == "SUCCEEDED")
        # 64 samples; the random tiny model calls the calculator in about a third of them
        turns = wait_for("a sample with a masked tool answer", lambda: browser.execute_script("""
            const masked = document.querySelector("#samples .turn.masked");
            if (!masked) return null;
            const card = masked.closest(".sample");
            return [...card.querySelectorAll(".turn.response")].map(
                (t) => [t.classList.contains("masked"), t.querySelector(".label").textContent]);"""))
        assert any(masked for masked, _ in turns) and any(not masked for masked, _ in turns), turns
        assert all(label.startswith("masked: not trained on") for masked, label in turns if masked), turns
        assert all(label.startswith("model, turn") for masked, label in turns if not masked), turns
        legend = wait_for("the eval reward in the reward chart", lambda: "eval/calc" in browser.find_element(
            By.CSS_SELECTOR, '.chart[data-group="reward"]').text and browser.find_element(
            By.CSS_SELECTOR, '.chart[data-group="reward"]').text, 60)
        assert "rollout/reward_mean" in legend, legend
    errors = console_errors(browser)
    assert not errors, errors
