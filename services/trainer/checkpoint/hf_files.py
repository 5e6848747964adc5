"""The files of an HF model directory besides its weights, copied next to every set of weights the trainer writes
(HF exports of either backend, the engines' weight snapshots), so each is a complete model for transformers and
SGLang."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
# a vision-language model's image processor (and its processor's settings), which the engines and the trainer read
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
INPUT_FILES = (*TOKENIZER_FILES, *PROCESSOR_FILES)  # what turns text and images into the model's inputs
SIDE_FILES = ("config.json", "generation_config.json", *INPUT_FILES)


def copy_side_files(source: str | Path, dest: str | Path, names: tuple[str, ...] = SIDE_FILES) -> None:
    """Copy those of `names` that `source` has into `dest` (a file already there as the same file is left alone)."""
    source, dest = Path(source), Path(dest)
    for name in names:
        if (source / name).is_file() and (source / name).resolve() != (dest / name).resolve():
            shutil.copy2(source / name, dest / name)
