"""The vision-language demo's synthetic task, made on the spot: "which colour is the square?" over generated images
(a square of one of a few colours, at a random place and size on a grey background, with pixel noise), answered by the
colour's name. Rows use slime's keys (`input`, `label`) and an `images` column of file names beside the dataset.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (210, 30, 30), "green": (30, 170, 40), "blue": (30, 50, 210), "yellow": (230, 210, 30),
           "purple": (140, 40, 170), "white": (245, 245, 245)}
BACKGROUND = (110, 110, 110)
PROMPT = "<image>which colour is the square?"
# The curriculum: the SFT warm-up sees big squares only, GRPO and the held-out test squares of every size down to a
# sixth of the canvas, where the grey around them dilutes the colour.
SFT_SCALE = (0.6, 1.0)
SCALE = (0.12, 0.5)


def draw(colour: str, rng: random.Random, scale: tuple[float, float]):
    """One image: a `colour` square (its shade jittered; its side `scale` of the canvas's shorter side) somewhere on
    a noisy grey canvas of random size."""
    from PIL import Image, ImageDraw

    width, height = rng.randint(40, 96), rng.randint(40, 96)
    image = Image.new("RGB", (width, height), BACKGROUND)
    side = max(4, int(min(width, height) * rng.uniform(*scale)))
    left, top = rng.randint(0, width - side), rng.randint(0, height - side)
    fill = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[colour])
    ImageDraw.Draw(image).rectangle((left, top, left + side - 1, top + side - 1), fill=fill)
    noise = Image.effect_noise((width, height), 12).convert("RGB")
    return Image.blend(image, noise, 0.08)


def write_colour_task(out_dir: Path, *, num_train: int = 600, num_test: int = 120, num_sft: int = 120,
                      seed: int = 0) -> tuple[Path, Path, Path]:
    """Write sft.jsonl, train.jsonl and test.jsonl (held out) with their PNGs under out_dir/images; returns their
    paths. Each file's images are its own (no image is in two files); colours are balanced in each."""
    out_dir = Path(out_dir)
    images = out_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    paths = []
    for split, count, scale in (("sft", num_sft, SFT_SCALE), ("train", num_train, SCALE),
                                ("test", num_test, SCALE)):
        rows = []
        for i in range(count):
            colour = names[i % len(names)]
            name = f"{split}-{i}.png"
            draw(colour, rng, scale).save(images / name, format="PNG")
            rows.append({"input": PROMPT, "label": colour, "images": [f"images/{name}"]})
        rng.shuffle(rows)
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1], paths[2]
