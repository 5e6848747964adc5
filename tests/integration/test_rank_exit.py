"""A trainer rank that ends through exit_rank exits with its own code, never SIGABRT: two-rank gloo worlds whose last
collective's gloo thread asks for the GIL late (tests/integration/exit_ranks.py) exit 0 run after run; the same
worlds ending through the interpreter abort, the hazard exit_rank steps around."""

from __future__ import annotations

import json
import signal

from tests.integration.workers import run_worker

RUNS = 20


def codes_of(ending: str, runs: int, tmp_path) -> list[list[int]]:
    out = tmp_path / f"{ending}.json"
    run_worker("tests.integration.exit_ranks", ending, str(runs), str(out), log_path=tmp_path / f"{ending}.log",
               timeout_s=600)
    return json.loads(out.read_text())


def test_every_rank_ending_through_exit_rank_exits_zero(tmp_path):
    assert codes_of("exit_rank", RUNS, tmp_path) == [[0, 0]] * RUNS


def test_the_same_worlds_ending_through_the_interpreter_abort(tmp_path):
    """What exit_rank steps around is still torch's: should this fail, the interpreter's exit no longer aborts here
    and exit_rank's skipping of the finalization may be dropped."""
    codes = [code for run in codes_of("interpreter", 2, tmp_path) for code in run]
    assert -signal.SIGABRT in codes, codes
    assert set(codes) <= {0, -signal.SIGABRT}, codes
