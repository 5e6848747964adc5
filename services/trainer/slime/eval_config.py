"""slime's --eval-config: a YAML `eval: {defaults: {...}, datasets: [{name, path, ...}]}` as the spec's eval keys.

Each dataset becomes an eval_prompt_data entry; a setting (from `defaults` or a dataset) becomes the spec's eval_*
key when every dataset has the same value; settings that differ between datasets, and those Physarum's eval has no
key for, are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# slime's dataset setting -> the spec key that holds it for all eval datasets
SETTINGS = {"n_samples_per_eval_prompt": "n_samples_per_eval_prompt", "temperature": "eval_temperature",
            "top_p": "eval_top_p", "top_k": "eval_top_k", "max_response_len": "eval_max_response_len",
            "input_key": "eval_input_key", "label_key": "eval_label_key"}
# settings that must equal the job's own (the eval uses the job's)
JOB_SETTINGS = ("rm_type", "custom_rm_path", "metadata_key", "apply_chat_template", "custom_generate_function_path")


def eval_spec(path: str, job: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(spec keys, problems) from the eval config at `path`; `job` holds the spec keys converted so far."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        return {}, [f"--eval-config {path}: cannot read it: {err}"]
    config = data.get("eval", data) if isinstance(data, dict) else None
    datasets = config.get("datasets") if isinstance(config, dict) else None
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        return {}, [f"--eval-config {path}: expected `eval.datasets`, a list of mappings with name and path"]
    defaults = dict(config.get("defaults") or {})
    problems = [f"--eval-config {path}: dataset {i} needs a name and a path" for i, d in enumerate(datasets)
                if not d.get("name") or not d.get("path")]
    spec: dict[str, Any] = {"eval_prompt_data": [f"{d.get('name')}={d.get('path')}" for d in datasets]}
    keys = {k for d in datasets for k in d if k not in ("name", "path")} | set(defaults)
    for key in sorted(keys):
        values = [d.get(key, defaults.get(key)) for d in datasets]
        if any(v != values[0] for v in values):
            problems.append(f"--eval-config {path}: `{key}` differs between datasets ({values}); Physarum's eval "
                            f"settings hold for all its datasets")
        elif key in SETTINGS:
            if values[0] is not None:
                spec[SETTINGS[key]] = values[0]
        elif key in JOB_SETTINGS:
            if values[0] is not None and job.get(key, values[0]) != values[0]:
                problems.append(f"--eval-config {path}: `{key}: {values[0]}` differs from the job's "
                                f"({job.get(key)}); the eval uses the job's")
        else:
            problems.append(f"--eval-config {path}: `{key}` has no counterpart in Physarum's eval")
    return spec, problems
