"""The short forms of `make fuzz` and `make chaos`: a sample of every hostile input class, and one kill of each kind
during a 10-rollout job, each on a stack of its own with authentication on."""

from __future__ import annotations

from tests.fuzz import chaos, fuzz


def test_fuzz_sample_is_refused_clearly_and_the_stack_stays_up(tmp_path):
    summary = fuzz.run(tmp_path, quick=True, seed=1)
    assert summary["inputs"] >= 80
    assert {k: summary[k] for k in ("accepted_unauthenticated", "internal_errors", "hangs", "crashes")} == \
        {"accepted_unauthenticated": 0, "internal_errors": 0, "hangs": 0, "crashes": 0}, summary
    assert summary["normal_job_after"] is True
    gateway = summary["gateway"]
    assert gateway["inputs"] >= 60 and (gateway["internal_errors"], gateway["hangs"], gateway["crashed"]) == (0, 0, 0)
    assert gateway["sessions_answering"] == gateway["sessions"], gateway


def test_chaos_one_kill_of_each_kind_loses_and_duplicates_nothing(tmp_path):
    summary = chaos.run(tmp_path, num_rollout=chaos.NUM_ROLLOUT, seed=1)
    assert (summary["lost"], summary["duplicated"], summary["job"]) == (0, 0, "SUCCEEDED"), summary
    assert summary["kills"] >= 1
