"""`make bench` (bench/run_all.py): every script in bench/ is run, and each one's figures are its last JSON line."""

from __future__ import annotations

from bench import run_all


def test_every_script_in_bench_is_run_or_a_named_helper():
    run_all.check_listed()  # raises naming a script that is in neither list
    assert not set(run_all.SCRIPTS) & run_all.HELPERS


def test_a_scripts_figures_are_its_last_json_line():
    out = 'table\n{"a": 1}\n| x | {"not json" |\n{"weight_sync_vs_gloo": 0.9}\n'
    assert run_all.last_json(out) == {"weight_sync_vs_gloo": 0.9}
    assert run_all.last_json("no figures\n") == {}

