"""The dashboard screenshot of docs/local-stack.md (docs/dashboard.png): a newcomer's path on the local stack,
photographed in headless Chromium.

`physarum up` (no --model: the demo's model), the demo's SFT warm-up (`--sft-rollouts` of its rollouts: a shorter
warm-up on a busy machine), then the demo's GRPO job; once GRPO has run `--rollouts` rollouts its page is saved as a
PNG (palette-reduced, so the repository stays small) and the stack is stopped. Needs Debian's chromium and
chromium-driver and the selenium package (the dev extra).

    .venv/bin/python scripts/dashboard_screenshot.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from physarum import stack
from services.common import auth

WORK_DIR = Path(".physarum/screenshot-stack")


def physarum(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "physarum", "--work-dir", str(WORK_DIR), *args], capture_output=True,
                          text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"physarum {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def wait_rollouts(url: str, token: str, job_id: str, num_rollouts: int, timeout_s: float = 3600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth.bearer(token), timeout=30).json()
        if job["state"] != "QUEUED" and job["state"] != "RUNNING":
            raise SystemExit(f"{job_id} ended ({job['state']}: {job['error']}) before {num_rollouts} rollouts")
        if job["rollout_id"] + 1 >= num_rollouts:
            return
        time.sleep(2)
    raise SystemExit(f"{job_id}: fewer than {num_rollouts} rollouts after {timeout_s} s")


def screenshot(page_url: str, token: str, out: Path, width: int) -> None:
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={WORK_DIR.resolve() / 'chromium-profile'}", "--window-size=1400,1900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(page_url)
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "login-submit").click()
        deadline = time.monotonic() + 60
        while not driver.find_elements(By.CSS_SELECTOR, "#samples .sample") and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)  # one more poll: every chart drawn
        raw = out.with_suffix(".raw.png")
        driver.save_screenshot(str(raw))
    finally:
        driver.quit()
    image = Image.open(raw).convert("RGB")
    image = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
    image.quantize(colors=64).save(out, optimize=True)
    raw.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--sft-rollouts", type=int, default=80, help="rollouts of the SFT warm-up (the demo's: 80)")
    parser.add_argument("--rollouts", type=int, default=60, help="GRPO rollouts done when the picture is taken")
    parser.add_argument("--width", type=int, default=1100, help="the PNG's width in pixels")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the stack on the way out
    try:
        printed = physarum("up", "--engines", "2")
        print(printed, end="")
        match = re.search(r"dashboard: (http://\S+)/dashboard/  token: (\S+)", printed)
        if not match:
            raise SystemExit("physarum up printed no dashboard address and token")
        url, token = match.groups()
        print(physarum("--token", token, "submit", "examples/demo/sft.yaml", "--set",
                       f"num_rollout={args.sft_rollouts}", "--wait"), end="")
        print(physarum("--token", token, "submit", "examples/demo/job.yaml"), end="")
        wait_rollouts(url, token, "demo-grpo", args.rollouts)
        screenshot(f"{url}/dashboard/#/job/demo-grpo", token, args.out, args.width)
        print(f"saved {args.out} ({args.out.stat().st_size} bytes)")
    finally:
        stack.down(WORK_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
