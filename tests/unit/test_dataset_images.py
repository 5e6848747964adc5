"""Prompt data with images (slime's multimodal keys): messages built as slime's `_build_messages` builds them, images
from files, data: URLs, base64 and Parquet bytes, and every bad image a skipped row whose error names it."""

from __future__ import annotations

import base64
import io
import json
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from services.buffer.dataset import read_prompts
from services.buffer.images import MAX_IMAGE_PIXELS, check_image
from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import prompt_from_proto, prompt_to_proto

KEYS = {"image": "images"}


def png(width: int = 4, height: int = 3, color: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def huge_png(width: int, height: int) -> bytes:
    """A valid PNG of width x height grey pixels, written by hand: small on disk (one compressed stream of zeros),
    so the test builds it without allocating the pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    compressor = zlib.compressobj()
    row = bytes(width + 1)
    body = b"".join(compressor.compress(row) for _ in range(16)) + compressor.flush()  # a prefix of the rows is enough
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_placeholders_become_image_parts_in_order_from_files_data_urls_and_base64(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(4, 3))
    second = png(5, 2, (0, 255, 0))
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"input": "Compare <image> with<image>. Which is red?", "label": "first",
         "images": ["img/a.png", "data:image/png;base64," + base64.b64encode(second).decode()]},
        {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>How many?"}],
         "images": [base64.b64encode(png(2, 2)).decode()]},
        {"input": "no image here", "images": None},
    ])
    rows = read_prompts(path, multimodal_keys=KEYS, roots=[str(tmp_path)])
    assert rows.num_skipped == 0, rows.errors
    first, second_row, text_only = rows.prompts
    assert first.prompt == "" and first.messages == [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " with"}, {"type": "image"},
        {"type": "text", "text": ". Which is red?"}]}]
    assert [(i.mime_type, i.width, i.height) for i in first.images] == [("image/png", 4, 3), ("image/png", 5, 2)]
    assert first.images[0].data == (tmp_path / "img" / "a.png").read_bytes() and first.images[1].data == second
    assert second_row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "How many?"}]}]
    assert [(i.width, i.height) for i in second_row.images] == [(2, 2)]
    # slime: multimodal keys put every prompt in the conversation form, with or without images
    assert text_only.messages == [{"role": "user", "content": "no image here"}] and text_only.images == []


def test_parquet_rows_carry_raw_bytes_and_datasets_image_structs(tmp_path):
    """slime's geo3k rows: an images column of Hugging Face datasets' Image structs (bytes, path)."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "problem": ["<image>Find x.", "<image>Find y."],
        "answer": ["3", "4"],
        "images": pa.array([[{"bytes": png(3, 3), "path": None}], [{"bytes": None, "path": "b.png"}]],
                           pa.list_(image_type)),
    })
    (tmp_path / "b.png").write_bytes(png(6, 1))
    pq.write_table(table, tmp_path / "train.parquet")
    rows = read_prompts(str(tmp_path / "train.parquet"), input_key="problem", label_key="answer",
                        multimodal_keys=KEYS, roots=[str(tmp_path)])
    assert rows.num_skipped == 0, rows.errors
    assert [(p.label, [(i.width, i.height) for i in p.images]) for p in rows.prompts] == [("3", [(3, 3)]),
                                                                                          ("4", [(6, 1)])]
    table = pa.table({"problem": ["<image>raw"], "images": pa.array([[png(1, 1)]], pa.list_(pa.binary()))})
    pq.write_table(table, tmp_path / "raw.parquet")
    assert read_prompts(str(tmp_path / "raw.parquet"), input_key="problem",
                        multimodal_keys=KEYS).prompts[0].images[0].data == png(1, 1)


def test_inline_image_parts_are_read_in_place(tmp_path):
    (tmp_path / "c.png").write_bytes(png(7, 7))
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"input": [{"role": "user", "content": [{"type": "image", "image": "c.png"}, {"type": "text", "text": "?"}]}]}])
    prompt = read_prompts(path, multimodal_keys=KEYS, roots=[str(tmp_path)]).prompts[0]
    assert prompt.messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    assert [(i.width, i.height) for i in prompt.images] == [(7, 7)]


def test_bad_images_skip_their_row_with_an_error_naming_it_and_keep_the_others(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "outside.png").write_bytes(png())
    (tmp_path / "data" / "ok.png").write_bytes(png())
    (tmp_path / "data" / "truncated.png").write_bytes(png(64, 64)[:60])
    (tmp_path / "data" / "notes.txt").write_text("not an image at all")
    (tmp_path / "data" / "huge.png").write_bytes(huge_png(10_000, 10_000))  # 100 megapixels
    broken = bytearray(png(8, 8))
    broken[40:48] = b"\x00" * 8  # inside IDAT: the stream no longer decodes
    rows = [
        {"input": "<image>", "images": ["ok.png"]},                           # line 1: kept
        {"input": "<image>", "images": ["missing.png"]},                      # line 2
        {"input": "<image>", "images": ["truncated.png"]},                    # line 3
        {"input": "<image>", "images": ["huge.png"]},                         # line 4
        {"input": "<image>", "images": ["../outside.png"]},                   # line 5
        {"input": "<image>", "images": ["notes.txt"]},                        # line 6
        {"input": "<image><image>", "images": ["ok.png"]},                    # line 7
        {"input": "<image>", "images": ["ok.png", "ok.png"]},                 # line 8
        {"input": "<image>", "images": ["https://example.com/a.png"]},        # line 9
        {"input": "<image>", "images": [{"image": "ok.png", "max_pixels": 9}]},  # line 10
        {"input": "<image> again", "images": ["ok.png"]},                     # line 11: kept
    ]
    path = write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    result = read_prompts(path, multimodal_keys=KEYS, roots=[str(tmp_path / "data")])
    assert len(result.prompts) == 2 and result.num_skipped == 9
    assert [p.messages[0]["content"][-1] for p in result.prompts] == [{"type": "image"}, {"type": "text",
                                                                                          "text": " again"}]
    errors = dict(e.split(": ", 1) for e in result.errors)
    where = f"dataset {path} line"
    assert errors[f"{where} 2"] == "'images' image 0: image 'missing.png': no such file"
    assert errors[f"{where} 3"].startswith("'images' image 0: corrupt image: ")
    assert errors[f"{where} 4"] == (f"'images' image 0: image of 10000x10000 pixels (100.0 megapixels; at most "
                                    f"{MAX_IMAGE_PIXELS / 1e6:.1f})")
    assert errors[f"{where} 5"].startswith("'images' image 0: image ") and "outside the allowed" in errors[f"{where} 5"]
    assert errors[f"{where} 6"].startswith("'images' image 0: not an image (19 bytes starting b'not an i')")
    assert errors[f"{where} 7"] == "more '<image>' placeholders in the prompt than the 1 images in 'images'"
    assert errors[f"{where} 8"] == "'images' holds 2 images but the prompt has 1 '<image>' placeholders"
    assert "fetches nothing from the network" in errors[f"{where} 9"]
    assert errors[f"{where} 10"] == ("'images' image 0: image object with unsupported keys ['max_pixels'] "
                                     "(expected bytes, path or image)")
    with pytest.raises(ValueError, match="corrupt image"):
        check_image(bytes(broken))


def test_unsupported_modalities_are_refused_before_any_row_is_read(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"input": "x"}])
    with pytest.raises(InvalidArgument, match="modality 'video' is not supported"):
        read_prompts(path, multimodal_keys={"video": "videos"})


def test_text_only_datasets_are_unchanged_and_images_travel_once_per_prompt_in_the_proto(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"input": "plain <image> text"}])
    plain = read_prompts(path).prompts[0]
    assert plain.prompt == "plain <image> text" and plain.messages == [] and plain.images == []
    assert prompt_to_proto(plain).ByteSize() == prompt_to_proto(plain).ByteSize()  # deterministic
    assert not prompt_to_proto(plain).images
    path = write_jsonl(tmp_path / "vlm.jsonl", [{"input": "<image>a<image>", "images": [
        "data:image/png;base64," + base64.b64encode(png(9, 9)).decode()] * 2}])
    prompt = read_prompts(path, multimodal_keys=KEYS).prompts[0]
    msg = prompt_to_proto(prompt)
    assert len(msg.images) == 2 and all(not m.content for m in msg.messages)
    assert [p.type for p in msg.messages[0].parts] == ["image", "text", "image"]
    again = prompt_from_proto(sample_pb2.Prompt.FromString(msg.SerializeToString()))
    assert again == prompt
