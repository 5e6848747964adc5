"""slime's argv read by argparse's rules: the last of a repeated flag wins, values take the type, choices, nargs and
action slime's parser declares (tests/data/slime_flag_decls.json, read from slime's arguments.py, Megatron's own
declarations for the flags slime leaves to Megatron), and the spec records where each value came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.spec import JobSpec, parse_spec
from services.trainer.slime_flags import args as slime_args
from services.trainer.slime_flags import argv as slime_argv

DECLS = json.loads((Path(__file__).parent.parent / "data" / "slime_flag_decls.json").read_text())
SPEC_KEYS = set(JobSpec.model_fields)
TINY = {"num_hidden_layers": 2, "hidden_size": 8, "rope_theta": 5000000}


def convert(argv: list[str], **kw):
    return slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False, **kw)


def test_the_tables_declare_what_slimes_parser_declares():
    for name, decl in DECLS.items():
        kind = {"json": "json", "int": "int", "float": "float"}.get(decl.get("type", "str"), "str")
        assert slime_argv.value_type(name) == kind, name
        if name != "train-backend":  # Physarum's spec also takes fsdp
            assert slime_argv.CHOICES.get(name) == (tuple(decl["choices"]) if "choices" in decl else None), name
        assert (name in slime_argv.NARGS_ANY) == (decl.get("nargs") == "*"), name
        assert (name in slime_argv.APPEND) == (decl.get("action") == "append"), name
        assert (name in slime_argv.BOOLEAN_OPTIONAL) == (decl.get("action") == "BooleanOptionalAction"), name


def test_a_repeated_flag_takes_its_last_value_and_says_so():
    # slime's retool script: the model block sets --rotary-base, its checkpoint block again (the SFT model's)
    argv = ["--rotary-base", "1000000", "--rollout-batch-size", "4", "--rotary-base", "5000000",
            "--rollout-batch-size", "8"]
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, hf_config=TINY)
    assert conv.refused == [] and conv.plugin_args["rotary_base"] == 5000000
    assert conv.spec["rollout_batch_size"] == 8
    assert conv.sources["rotary_base"] == "--rotary-base (argv[4]), the last of 2: over argv[0]"
    assert conv.sources["rollout_batch_size"] == "--rollout-batch-size (argv[6]), the last of 2: over argv[2]"
    conv = slime_args.convert(argv[4:6] + argv[:2], spec_keys=SPEC_KEYS, hf_config=TINY)  # the other order
    assert [r.split(" disagrees")[0] for r in conv.refused] == ["--rotary-base 1000000"]


def test_values_take_slimes_types_not_yamls():
    conv = convert(["--wandb-run-id", "0123", "--input-key", "true", "--rollout-temperature", "1",
                    "--rollout-stop-token-ids", "7", "8", "--rollout-stop", "1", "--eval-prompt-data", "aime",
                    "a.jsonl"])
    assert conv.invalid == []
    assert conv.spec["wandb_run_id"] == "0123" and conv.spec["input_key"] == "true"  # str: kept as written
    assert conv.spec["rollout_temperature"] == 1.0 and isinstance(conv.spec["rollout_temperature"], float)
    assert conv.spec["rollout_stop_token_ids"] == [7, 8] and conv.spec["rollout_stop"] == ["1"]
    assert conv.spec["eval_prompt_data"] == ["aime", "a.jsonl"]


@pytest.mark.parametrize("argv, message", [
    (["--rollout-batch-size", "4.5"], "--rollout-batch-size: invalid int value: '4.5'"),
    (["--lr", "fast"], "--lr: invalid float value: 'fast'"),
    (["--advantage-estimator", "grpo2"], "--advantage-estimator: invalid choice: 'grpo2' (choose from grpo, gspo, "
                                         "cispo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo)"),
    (["--rollout-batch-size", "4", "8"], "--rollout-batch-size expects one value, got 2: 4 8"),
    (["--rollout-batch-size"], "--rollout-batch-size expects one value, got none"),
    (["--eval-prompt-data"], "--eval-prompt-data expects at least one value"),
    (["--use-kl-loss", "yes"], "--use-kl-loss takes no value, got yes"),
])
def test_values_slimes_parser_rejects_are_rejected_naming_the_flag(argv, message):
    assert convert(argv).invalid == [message]


def test_append_and_boolean_optional_actions():
    conv = convert(["--rollout-sample-hook-path", "a.f", "--lr", "1e-6", "--rollout-sample-hook-path", "b.g"])
    assert slime_argv.last_wins(slime_argv.split_argv_at(["--rollout-sample-hook-path", "a.f", "--lr", "1",
                                                         "--rollout-sample-hook-path", "b.g"]))[0][-1] == (
        "rollout-sample-hook-path", ["a.f", "b.g"])
    assert conv.sources["rollout_sample_hook_path"] == "--rollout-sample-hook-path (argv[0, 4], appended)"
    assert convert(["--offload-train", "--no-offload-train"]).plugin_args["offload_train"] is False
    assert convert(["--no-offload-train", "--offload-train"]).plugin_args["offload_train"] is True


def test_the_spec_records_where_each_value_came_from(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    argv = (f"--hf-checkpoint {tmp_path} --prompt-data d.jsonl --rollout-batch-size 4 --num-rollout 10 "
            "--lr 1e-5 --lr 2e-5 --lr-warmup-fraction 0.5 --rotary-base 5000000")
    spec = parse_spec({"slime_args": argv, "rollout_batch_size": 2, "job_id": "j"})
    assert spec.lr == 2e-5 and spec.rollout_batch_size == 2
    assert spec.slime_sources["lr"] == "--lr (argv[10]), the last of 2: over argv[8]"
    assert spec.slime_sources["rollout_batch_size"] == "the spec's own rollout_batch_size (over " \
                                                       "--rollout-batch-size (argv[4]))"
    assert spec.slime_sources["lr_warmup_iters"] == "5 = lr_warmup_fraction × 10 optimizer steps"
    assert spec.slime_sources["rotary_base"] == "--rotary-base (argv[14])"
    assert "slime_sources" not in spec.plugin_args_view()
    with pytest.raises(InvalidArgument, match=r"^slime_args: --num-rollout: invalid int value: 'ten'; "):
        parse_spec({"slime_args": argv + " --num-rollout ten --use-opsm"})
