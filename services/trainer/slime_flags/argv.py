"""slime's argv read as slime's argparse reads it: a shell string split as bash would, a repeated flag's last value
winning (an `append` flag collecting them), `--no-<flag>` of a BooleanOptionalAction, and each value of slime's own
flags taken with the type, choices and count its parser declares. Sorting the flags is args.py's job.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from services.common.errors import InvalidArgument
from services.trainer.slime_flags.flags import FLAGS, spec_key

# How slime's parser reads each flag's value (argparse `type=`, `choices=`, `nargs=`, `action=`); a flag listed in
# none of these takes one string, kept as written.
INT_FLAGS = frozenset({
    "actor-num-gpus-per-node", "actor-num-nodes", "ckpt-step", "data-pad-size-multiplier",
    "distributed-timeout-minutes",
    "eval-interval", "eval-max-context-len", "eval-max-prompt-len", "eval-max-response-len", "eval-min-new-tokens",
    "eval-top-k", "fetch-trajectory-retry-times", "global-batch-size", "log-probs-chunk-size",
    "log-probs-max-tokens-per-gpu", "max-tokens-per-gpu", "megatron-deepgemm-forward-layers",
    "megatron-deepgemm-moe-forward-layers", "memory-snapshot-num-steps", "micro-batch-size", "mtp-num-layers",
    "n-samples-per-eval-prompt", "n-samples-per-prompt", "num-critic-only-steps", "num-epoch", "num-gpus-per-node",
    "num-rollout", "num-steps-per-rollout", "opd-teacher-ckpt-step", "over-sampling-batch-size", "padded-vocab-size",
    "ref-ckpt-step", "ref-update-interval", "rollout-batch-size", "rollout-max-context-len", "rollout-max-prompt-len",
    "rollout-max-response-len", "rollout-num-gpus", "rollout-num-gpus-per-engine", "rollout-seed",
    "rollout-stop-token-ids", "rollout-top-k", "save-interval", "seed", "sglang-router-port",
    "sglang-router-request-timeout-secs", "sglang-server-concurrency", "start-rollout-id", "update-weight-buffer-size",
    "update-weights-interval"})
FLOAT_FLAGS = frozenset({
    "ci-train-rollout-logprob-abs-diff-threshold", "clip-grad", "entropy-coef", "eps-clip", "eps-clip-c",
    "eps-clip-high", "eval-temperature", "eval-top-p", "gamma", "kl-coef", "kl-loss-coef", "lambd",
    "load-debug-rollout-data-subsample", "lr", "min-batch-collection-ratio", "mtp-loss-scaling-factor", "opd-kl-coef",
    "opsm-delta", "rollout-health-check-first-wait", "rollout-health-check-interval", "rollout-health-check-timeout",
    "rollout-temperature", "rollout-top-p", "tis-clip", "tis-clip-low", "value-clip"})
JSON_FLAGS = frozenset({"apply-chat-template-kwargs", "multimodal-keys", "train-env-vars"})  # type=json.loads
# (slime's --train-backend allows only megatron; Physarum also takes fsdp, so it is not listed)
CHOICES: dict[str, tuple[str, ...]] = {
    "advantage-estimator": ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"),
    "distributed-backend": ("nccl", "gloo"),
    "kl-loss-type": ("k1", "k2", "k3", "low_var_kl"),
    "loss-mask-type": ("qwen", "qwen3", "qwen3_5", "distill_qwen"),
    "loss-type": ("policy_loss", "sft_loss", "custom_loss"),
    "memory-recorder": ("torch", "memray"),
    "opd-type": ("sglang", "megatron"),
    "profile-target": ("train_overall", "train_actor", "train_log_probs"),
    "qwen-gdn-backend": ("fla", "flashqla"),
    "rollout-data-transport": ("object-store", "nixl"),
    "update-weight-delta-checksum": ("xxh3-128", "blake3", "adler32"),
    "update-weight-delta-encoding": ("xor", "overwrite"),
    "update-weight-mode": ("full", "delta"),
    "update-weight-transport": ("nccl", "disk"),
    "wandb-mode": ("online", "offline", "disabled"),
}
NARGS_ANY = frozenset({"freeze-params-name-list", "only-train-params-name-list"})  # nargs="*"; other nargs are "+"
APPEND = frozenset({"rollout-sample-hook-path"})  # action="append": each occurrence adds one value
BOOLEAN_OPTIONAL = frozenset({"offload-rollout", "offload-train"})  # --no-<flag> sets False


def value_type(name: str) -> str:
    """'int', 'float', 'json' or 'str': what slime's parser turns a value of `--name` into."""
    return "int" if name in INT_FLAGS else "float" if name in FLOAT_FLAGS else "json" if name in JSON_FLAGS else "str"


def split_argv(argv: str | list[str]) -> list[tuple[str, list[str]]]:
    """`--a 1 --b --c x y` -> [("a", ["1"]), ("b", []), ("c", ["x", "y"])]; a shell string is split as bash would
    (comments and line continuations included)."""
    return [(name, values) for _, name, values in split_argv_at(argv)]


def split_argv_at(argv: str | list[str]) -> list[tuple[int, str, list[str]]]:
    """split_argv with each flag's position in the argument list: [(index, name, values)]."""
    if isinstance(argv, str):
        argv = shlex.split(argv.replace("\\\n", " "), comments=True)
    items: list[tuple[int, str, list[str]]] = []
    for index, token in enumerate(argv):
        if token.startswith("--") and len(token) > 2:
            items.append((index, token[2:], []))
        elif not items:
            raise InvalidArgument(f"slime_args: expected a --flag first, got {token!r}")
        else:
            items[-1][2].append(token)
    return items


def destination(name: str) -> str:
    """The flag a spelling sets: `no-offload-train` sets offload-train (argparse's BooleanOptionalAction)."""
    base = name.removeprefix("no-")
    return base if name.startswith("no-") and base in BOOLEAN_OPTIONAL else name


def last_wins(items: list[tuple[int, str, list[str]]]) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """argparse's rule for a repeated flag: its last occurrence wins (an `append` flag collects every value).
    Returns the flags in the order of their deciding occurrence and, by key, where each value came from."""
    seen: dict[str, list[tuple[int, str, list[str]]]] = {}
    for item in items:
        seen.setdefault(destination(item[1]), []).append(item)
    decided = sorted(seen.items(), key=lambda entry: entry[1][-1][0])
    pairs, sources = [], {}
    for dest, occurrences in decided:
        index, name, values = occurrences[-1]
        where = f"--{name} (argv[{index}])"
        if len(occurrences) > 1 and dest in APPEND:
            values = [v for occurrence in occurrences for v in occurrence[2]]
            where = f"--{name} (argv[{', '.join(str(o[0]) for o in occurrences)}], appended)"
        elif len(occurrences) > 1:
            where += f", the last of {len(occurrences)}: over argv[{', '.join(str(o[0]) for o in occurrences[:-1])}]"
        pairs.append((name, values))
        sources[spec_key(dest)] = where
    return pairs, sources


def slime_value(name: str, values: list[str]) -> Any:
    """The value slime's parser gives `--name` (its type, choices, nargs and action); InvalidArgument as argparse
    would fail."""
    flag = FLAGS[name]
    if flag.bare:
        if values:
            raise InvalidArgument(f"--{name} takes no value, got {' '.join(values)}")
        return True
    if flag.nargs:
        if not values and name not in NARGS_ANY:
            raise InvalidArgument(f"--{name} expects at least one value")
        return [_typed(name, v) for v in values]
    if len(values) != 1:
        got = f"{len(values)}: {' '.join(values)}" if values else "none"
        raise InvalidArgument(f"--{name} expects one value, got {got}")
    return _typed(name, values[0])


def _typed(name: str, text: str) -> Any:
    kind = value_type(name)
    try:
        value = int(text) if kind == "int" else float(text) if kind == "float" else \
            json.loads(text) if kind == "json" else text
    except ValueError:
        raise InvalidArgument(f"--{name}: invalid {kind} value: {text!r}") from None
    if name in CHOICES and value not in CHOICES[name]:
        raise InvalidArgument(f"--{name}: invalid choice: {text!r} (choose from {', '.join(CHOICES[name])})")
    return value
