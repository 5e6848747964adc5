"""slime's --eval-config: a YAML `eval: {defaults: {...}, datasets: [{name, path, ...}]}` as the spec's eval keys.

Each dataset becomes an eval_prompt_data entry. A setting (from `defaults` or a dataset, the dataset's winning) that
every dataset has alike becomes the spec's eval_* key; one that differs goes into eval_dataset_settings for the
datasets that set it, as slime resolves them (dataset, then defaults, then the job's flags). Settings Physarum's
eval has no counterpart for are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from services.common.settings.rollout import EVAL_DATASET_SETTINGS

# slime's dataset setting -> the spec key that holds it for every eval dataset
SETTINGS = {"n_samples_per_eval_prompt": "n_samples_per_eval_prompt", "temperature": "eval_temperature",
            "top_p": "eval_top_p", "top_k": "eval_top_k", "max_response_len": "eval_max_response_len",
            "input_key": "eval_input_key", "label_key": "eval_label_key"}
# settings that must equal the job's own (the eval uses the job's)
JOB_SETTINGS = ("apply_chat_template", "custom_generate_function_path")


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
    own: dict[str, dict[str, Any]] = {}
    keys = {k for d in datasets for k in d if k not in ("name", "path")} | set(defaults)
    for key in sorted(keys):
        values = [d.get(key, defaults.get(key)) for d in datasets]
        alike = all(v == values[0] for v in values)
        if key in JOB_SETTINGS:
            if any(v is not None and (job.get(key) or None) != (v or None) for v in values):
                problems.append(f"--eval-config {path}: `{key}: {values}` differs from the job's ({job.get(key)}); "
                                f"the eval uses the job's")
        elif key not in EVAL_DATASET_SETTINGS:
            problems.append(f"--eval-config {path}: `{key}` has no counterpart in Physarum's eval")
        elif alike and key in SETTINGS:
            if values[0] is not None:
                spec[SETTINGS[key]] = values[0]
        else:  # differs between datasets, or a setting with no eval_* key of its own (rm_type, metadata_key, ...)
            for dataset, value in zip(datasets, values, strict=True):
                if value is not None:
                    own.setdefault(str(dataset.get("name")), {})[key] = value
    if own:
        spec["eval_dataset_settings"] = own
    return spec, problems
