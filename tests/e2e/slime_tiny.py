"""A slime example's argv made to run on one CPU with a tiny model of its family: what changes and nothing else.

- the model: a tiny one of the example's family (2 layers, hidden 128; its tokenizer by character, over printable
  ASCII so the plugins' prompts tokenize, with a 2048-token context: retool's system prompt is ~900 characters);
- the model block's architecture flags take the tiny model's values (read from its config.json the way the submit
  check reads them); a bare flag stays where the tiny model has the feature and goes where it does not (the tiny
  Qwen3 ties its embeddings: `--untie-embeddings-and-output-weights` goes);
- parallelism sizes become 1 (one trainer rank, one engine per model), and the uneven pipeline stages' layer counts
  go (one stage holds every layer);
- batch sizes and lengths become tiny (two rollouts, or two epochs of the two prompts, of two prompts × two samples
  (one where the script samples one), eight tokens each);
- paths name the test's files: the tiny model for `--hf-checkpoint`, `--ref-load` and `--opd-teacher-load` (an HF
  directory; slime's torch_dist layout is read in tests/integration/test_megatron_slime_checkpoint.py), empty
  directories for `--load` and `--save`, prompt rows with the example's keys, the eval files and YAMLs, and
  `--rm-url` (slime's OPD teacher) naming an engine of the test's.
- slime's zero-std group filter goes: an untrained tiny model scores every sample of a group alike, so it would drop
  every group (its mapping to the rollout service's built-in is checked at submit, in tests/unit/test_slime_args.py);
Every other flag (algorithm, rollout function, hooks and plugins, eval settings) is kept as slime's script wrote it.
"""

from __future__ import annotations

import io
import json
import string
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from physarum import tasks, tinymodel
from services.trainer.models.families import language_model_config
from services.trainer.slime_flags.megatron_flags import ARCH

# Parallelism: the test's stack has one trainer rank and single-process CPU engines.
ONE = ("actor-num-nodes", "actor-num-gpus-per-node", "rollout-num-gpus", "rollout-num-gpus-per-engine",
       "tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
       "expert-model-parallel-size", "expert-tensor-parallel-size",
       "sglang-tp-size", "sglang-dp-size", "sglang-ep-size", "sglang-pp-size", "sglang-moe-dense-tp-size")
# slime's zero-std filter, dropped (see the docstring)
ZERO_STD_FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
# The layer counts of uneven pipeline stages, which one stage has no use for.
UNEVEN_STAGES = ("decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers")
# Sizes: one optimizer step per rollout of 2 prompts × 2 samples; responses short enough for a 2-layer model on CPU.
TINY = {"num-rollout": "2", "num-epoch": "2", "rollout-batch-size": "2", "n-samples-per-prompt": "2",
        "global-batch-size": "4", "rollout-max-response-len": "8", "eval-max-response-len": "8",
        "n-samples-per-eval-prompt": "2",
        **{flag: "1" for flag in ONE}}
PROMPTS = [{"prompt": "What is 1+2?", "label": "3"}, {"prompt": "What is 2+2?", "label": "4"}]
EVAL_PROMPT = {"prompt": "What is 3+3?", "label": "6"}


CONTEXT_LEN = 2048


# Families whose checkpoints ship their own modeling code: a tiny one of transformers' family it is shaped as, plus
# what it adds (MiMo: Qwen2 with multi-token-prediction layers under MiMo's names, testkit/mtp_checkpoints.py)
REMOTE_CODE_FAMILIES = {"mimo": "qwen2"}
# Families whose slime scripts train the checkpoint's MTP layer: their tiny model carries one, under DeepSeek's names
# (GLM-4.7-Flash: run-glm4.7-30B-A3B.sh's --mtp-num-layers 1)
WITH_MTP_LAYER = ("glm4_moe_lite",)
# Vision-language stacks: the tiny vision-language model of a family (physarum/tinyvlm.py), with its vision tower
VISION_LANGUAGE = {"qwen3_5_moe_vl": "qwen3_5_moe"}


def build_tiny_model(out_dir: Path, family: str) -> Path:
    """A tiny model of `family` with its character tokenizer, in one HF directory (built once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from physarum.families import tiny_config

    if family in VISION_LANGUAGE:
        from physarum.tinyvlm import build_tiny_vlm

        return build_tiny_vlm(out_dir, [*tasks.corpus(), string.printable], family=VISION_LANGUAGE[family])
    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tinymodel.build_tokenizer([*tasks.corpus(), string.printable], out_dir)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = tiny_config(REMOTE_CODE_FAMILIES.get(family, family), vocab_size=len(vocab),
                         eos_id=vocab[tinymodel.EOS_TOKEN])
    config.max_position_embeddings = CONTEXT_LEN
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir, safe_serialization=True)
    if family == "mimo":
        from testkit.mtp_checkpoints import add_mtp_layers

        add_mtp_layers(out_dir, 1)
    if family in WITH_MTP_LAYER:
        from testkit.mtp_checkpoints import add_deepseek_mtp_layer

        add_deepseek_mtp_layer(out_dir)
    return out_dir


def split_flags(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag, its values)] in argv order (a value never starts with `--` in slime's scripts)."""
    flags: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            flags.append((token[2:], []))
        else:
            flags[-1][1].append(token)
    return flags


def arch_values(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The tiny model's value of each architecture flag its config says (None: it does not say); a multimodal
    model's, its language model's (text_config), as the submit check reads them."""
    config = {**language_model_config(hf_config), "model_type": hf_config.get("model_type")}
    return {flag: arch.expected(config) for flag, arch in ARCH.items()}


def tiny_argv(argv: list[str], *, model_dir: Path, work_dir: Path, rm_url: str = "") -> list[str]:
    """`argv` with the changes in this module's docstring; writes the files it names under `work_dir`."""
    tiny = arch_values(json.loads((model_dir / "config.json").read_text()))
    paths = {"hf-checkpoint": str(model_dir), "ref-load": str(model_dir), "opd-teacher-load": str(model_dir),
             "load": str(work_dir / "load"), "save": str(work_dir / "save"), "rm-url": rm_url}
    out: list[str] = []
    for flag, values in split_flags(argv):
        if flag in UNEVEN_STAGES:
            continue
        if flag == "dynamic-sampling-filter-path" and values == [ZERO_STD_FILTER]:
            continue
        if flag in ARCH:
            if tiny[flag] is None:
                continue
            if ARCH[flag].bare:
                out += [f"--{flag}"] if tiny[flag] else []
            else:
                out += [f"--{flag}", str(tiny[flag])]
        elif flag == "global-batch-size" and "--n-samples-per-prompt" not in argv:  # one sample per prompt (SFT)
            out += [f"--{flag}", TINY["rollout-batch-size"]]
        elif flag in TINY:
            out += [f"--{flag}", TINY[flag]]
        elif flag in paths:
            out += [f"--{flag}", paths[flag]]
        elif flag == "prompt-data":
            path = work_dir / f"train{Path(values[0]).suffix}"
            out += [f"--{flag}", str(write_rows(path, example_rows(PROMPTS, argv)))]
        elif flag == "eval-prompt-data":  # name path pairs
            pairs = []
            for name, given in zip(values[0::2], values[1::2], strict=True):
                path = write_rows(work_dir / f"eval-{name}{Path(given).suffix}", example_rows([EVAL_PROMPT], argv))
                pairs += [name, str(path)]
            out += [f"--{flag}", *pairs]
        elif flag == "eval-config":
            out += [f"--{flag}", str(write_eval_config(work_dir))]
        else:
            out += [f"--{flag}", *values]
    return out


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def example_rows(rows: list[dict], argv: list[str]) -> list[dict]:
    """`rows` under the script's --input-key / --label-key, in the form its data has: chat messages for a
    `messages` key (gsm8k's), a dict of ground-truth targets for a `reward_model` label (Search-R1's); under
    --multimodal-keys an image per prompt, its PNG bytes in the image column and `<image>` in the prompt (geo3k's)."""
    given = dict(zip(argv, argv[1:], strict=False))
    input_key, label_key = given.get("--input-key", "input"), given.get("--label-key", "label")
    image_key = json.loads(given.get("--multimodal-keys", "{}")).get("image")
    out = []
    for i, row in enumerate(rows):
        text = f"<image>{row['prompt']}" if image_key else row["prompt"]
        prompt = [{"role": "user", "content": text}] if input_key == "messages" else text
        label = {"ground_truth": {"target": [row["label"]]}, "style": "rule"} if label_key == "reward_model" \
            else row["label"]
        out.append({input_key: prompt, label_key: label, **({image_key: [_png(i)]} if image_key else {})})
    return out


def _png(seed: int) -> bytes:
    """A small solid image, its color by `seed`."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40 + 8 * seed, 56), ((60 * seed) % 256, 120, 200)).save(out, format="PNG")
    return out.getvalue()


def write_eval_config(work_dir: Path) -> Path:
    """slime's eval_multi_task/multi_task.yaml: two datasets, each its own samples per prompt and reward, the
    defaults' lengths tiny."""
    datasets = [{"name": "aime", "path": str(write_rows(work_dir / "aime.jsonl", [EVAL_PROMPT])),
                 "rm_type": "deepscaler", "n_samples_per_eval_prompt": 4},
                {"name": "gpqa", "path": str(write_rows(work_dir / "gpqa.jsonl", [{"prompt": "A or B?",
                                                                                   "label": "A"}])),
                 "rm_type": "gpqa", "n_samples_per_eval_prompt": 2}]
    path = work_dir / "multi_task.yaml"
    path.write_text(yaml.safe_dump({"eval": {"defaults": {"max_response_len": 8, "top_p": 0.7},
                                             "datasets": datasets}}))
    return path
