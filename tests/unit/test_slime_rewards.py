"""slime's reward models: each (response, label) of tests/data/slime_rewards.json scores what slime's own function
gave for it (the table was produced by running slime's rm_hub functions once); plus rm_type dispatch."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.samples import Sample
from services.reward import verifiers
from services.reward.rm import remote

TABLE = json.loads((Path(__file__).parent.parent / "data" / "slime_rewards.json").read_text())


def builtin(rm_type: str, response: str, label: Any, metadata: dict | None = None, args: dict | None = None) -> Any:
    sample = Sample(response=response, label=label, metadata=metadata or {})
    return asyncio.run(verifiers.score_builtin(sample, rm_type, args or {}))


def cases(rm_type: str) -> list:
    return [pytest.param(*case, id=f"{rm_type}-{i}") for i, case in enumerate(TABLE[rm_type])]


def test_every_type_has_at_least_20_cases():
    assert {k: len(v) >= 20 for k, v in TABLE.items()} == dict.fromkeys(TABLE, True)


@pytest.mark.parametrize("response, label, expected", cases("math"))
def test_math_equals_slime(response, label, expected):
    assert builtin("math", response, label) == expected


@pytest.mark.parametrize("response, label, expected", cases("deepscaler"))
def test_deepscaler_equals_slime(response, label, expected):
    assert builtin("deepscaler", response, label) == expected


@pytest.mark.parametrize("response, label, expected", cases("dapo"))
def test_dapo_equals_slime(response, label, expected):
    assert builtin("dapo", response, label) == expected


@pytest.mark.parametrize("response, label, expected", cases("f1"))
def test_f1_equals_slime(response, label, expected):
    assert builtin("f1", response, label) == pytest.approx(expected, abs=0, rel=1e-12)


@pytest.mark.parametrize("response, label, metadata, expected", cases("gpqa"))
def test_gpqa_equals_slime(response, label, metadata, expected):
    assert builtin("gpqa", response, label, metadata) == expected


@pytest.mark.parametrize("response, label, expected", cases("boxed_f1"))
def test_boxed_prefix_scores_the_boxed_content(response, label, expected):
    assert builtin("boxed_f1", response, label) == pytest.approx(expected, abs=0, rel=1e-12)


def test_metadata_rm_type_wins_over_the_jobs():
    assert builtin("math", "Paris", "paris", metadata={"rm_type": "f1"}) == 1.0
    assert builtin("f1", r"\boxed{4}", "4", metadata={"rm_type": " math "}) == 1


def test_unknown_metadata_rm_type_fails_the_sample():
    with pytest.raises(Exception, match="sample 0: unknown rm_type 'nope'"):
        builtin("math", "x", "x", metadata={"rm_type": "nope"})


def test_random_gives_0_or_1_and_both_happen():
    assert {builtin("random", "", "") for _ in range(60)} == {0, 1}


def test_labels_keep_their_type():
    assert builtin("deepscaler", r"</think>\boxed{7}", 7) == 1
    with pytest.raises(TypeError, match="deepscaler: the label must be a string or a number, got dict"):
        builtin("deepscaler", r"</think>\boxed{7}", {"ground_truth": "7"})


class _FlakyRM(BaseHTTPRequestHandler):
    """Answers 503 to the first `failures` requests, then {"score": len(response)} for the posted sample."""

    failures = 0
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if type(self).failures > 0:
            type(self).failures -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply = json.dumps({"score": len(body["response"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def rm_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FlakyRM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FlakyRM.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    thread.join(timeout=10)


def test_remote_rm_posts_the_sample_and_retries_a_5xx(rm_url):
    _FlakyRM.failures = 2
    sample = Sample(prompt="q", response="four", label={"ground_truth": "4"})
    result = asyncio.run(remote.remote_reward(rm_url, sample.prompt, sample.response, sample.label, attempts=3,
                                              base_delay_s=0.01))
    assert result == {"score": 4}
    assert _FlakyRM.seen == [{"prompt": "q", "response": "four", "label": {"ground_truth": "4"}}] * 3


def test_remote_rm_gives_up_after_its_attempts(rm_url):
    _FlakyRM.failures = 5
    with pytest.raises(httpx.HTTPStatusError, match="503"):
        asyncio.run(remote.remote_reward(rm_url, "q", "r", "l", attempts=2, base_delay_s=0.01))
    assert len(_FlakyRM.seen) == 2


def test_remote_rm_through_the_dispatch_needs_rm_url(rm_url):
    assert builtin("remote_rm", "abc", "x", args={"rm_url": rm_url}) == {"score": 3}
    with pytest.raises(ValueError, match="remote_rm needs rm_url"):
        builtin("remote_rm", "abc", "x")


@pytest.mark.parametrize("response, label, expected", cases("dapo_strict"))
def test_dapo_strict_box_equals_slime(response, label, expected):
    """slime's compute_score(strict_box_verify=True), which its retool example's reward uses."""
    from services.reward.rm.dapo import dapo_reward

    assert dapo_reward(response, label, strict_box=True) == expected
