"""`make demo-vlm`: the visual task's files (balanced colours, the curriculum's square sizes, each image in one file
only, images the buffer's reader accepts) and both job files as valid specs on images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from physarum.cli import load_job_file
from physarum.demo import job_overrides
from physarum.demo_vlm import EXAMPLES
from physarum.visual_task import BACKGROUND, COLOURS, write_colour_task
from services.buffer.images import read_image
from services.trainer.api.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]


def square_share(path: Path) -> float:
    """The square's side over the canvas's shorter side: the pixels far from the grey background."""
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.int32)
    square = np.abs(pixels - np.array(BACKGROUND)).sum(axis=2) > 60
    rows, cols = np.nonzero(square)
    return (rows.max() - rows.min() + 1) / min(pixels.shape[:2]) if rows.size else 0.0


def test_the_task_is_balanced_held_out_and_its_warm_up_sees_big_squares_only(tmp_path):
    sft, train, test = write_colour_task(tmp_path, num_train=60, num_test=30, num_sft=30, seed=1)
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()]
            for name, path in (("sft", sft), ("train", train), ("test", test))}
    assert {name: len(r) for name, r in rows.items()} == {"sft": 30, "train": 60, "test": 30}
    for name, split in rows.items():
        counts = {colour: sum(r["label"] == colour for r in split) for colour in COLOURS}
        assert set(counts.values()) == {len(split) // len(COLOURS)}, (name, counts)
    files = [r["images"][0] for split in rows.values() for r in split]
    assert len(set(files)) == len(files)  # no image in two files
    for split in rows.values():
        for row in split[:6]:
            image = read_image(row["images"][0], base_dir=tmp_path, roots=[str(tmp_path)])
            assert image.mime_type == "image/png" and 40 <= min(image.width, image.height) <= 96
    big = [square_share(tmp_path / r["images"][0]) for r in rows["sft"]]
    small = [square_share(tmp_path / r["images"][0]) for r in rows["train"] + rows["test"]]
    assert min(big) > 0.55 and max(small) < 0.56, (min(big), max(small))


def test_both_job_files_are_valid_specs_on_images_starting_from_the_model_built():
    sft_sets, grpo_sets = job_overrides([], 2, Path("/models/vlm"), [], [])
    sft = parse_spec(load_job_file(REPO / EXAMPLES / "sft.yaml", sft_sets))
    grpo = parse_spec(load_job_file(REPO / EXAMPLES / "job.yaml", grpo_sets))
    assert (sft.loss_type, sft.hf_checkpoint, sft.seed, sft.save_hf) == ("sft_loss", "/models/vlm", 2,
                                                                         ".physarum/demo-vlm/sft-model")
    assert grpo.hf_checkpoint == sft.save_hf and grpo.advantage_estimator == "grpo"
    assert sft.multimodal_keys == grpo.multimodal_keys == {"image": "images"}
