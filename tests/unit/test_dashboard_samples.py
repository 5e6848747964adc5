"""The dashboard's sample records and log tail: a response cut into turns at the loss mask's edges, decoded with the
job model's real tokenizer; the latest rollout per job, bounded; log lines picked per job."""

from __future__ import annotations

import logging

import pytest
from tokenizers import Tokenizer

from physarum import tasks, tinymodel
from services.common.samples import Sample, Status
from services.trainer.dashboard.logtail import LogTail
from services.trainer.driver.sample_board import SampleBoard, mask_runs, turns_of


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    tinymodel.build_tokenizer(tasks.corpus(), out)
    return out


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_mask_runs_are_the_maximal_runs_of_equal_values():
    assert mask_runs([1, 1, 0, 0, 0, 1]) == [(0, 2, False), (2, 5, True), (5, 6, False)]
    assert mask_runs([0]) == [(0, 1, True)]
    assert mask_runs([]) == []


def test_a_multi_turn_response_shows_turn_by_turn_with_the_tool_output_masked(model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt, model_turn, tool, answer = ids(tokenizer, "2*3="), ids(tokenizer, "2*3="), ids(tokenizer, "6\n"), \
        ids(tokenizer, "6")
    response = model_turn + tool + answer
    sample = Sample(prompt="2*3=", tokens=prompt + response, response="2*3=6\n6", response_length=len(response),
                    loss_mask=[1] * len(model_turn) + [0] * len(tool) + [1] * len(answer), reward=1.0)
    turns = turns_of(sample, tokenizer)
    assert [(t.text, t.masked, t.num_tokens) for t in turns] == [("2*3=", False, 4), ("6\n", True, 2), ("6", False, 1)]


def test_a_single_turn_response_is_one_turn_of_its_text(model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sample = Sample(prompt="1+1=", tokens=ids(tokenizer, "1+1=2"), response="2", response_length=1, loss_mask=[1])
    assert [(t.text, t.masked) for t in turns_of(sample, tokenizer)] == [("2", False)]


def test_an_agent_sample_shows_its_sessions_turns_and_branches(model_dir):
    board = SampleBoard()
    agent = Sample(prompt="q", tokens=[5, 6], response="a", response_length=1, loss_mask=[1], metadata={
        "agent_turns": 3, "agent_branches": [{"turn": 2, "reason": "continues turn 0, not the last turn 1"}]})
    board.record("a", 0, [agent, Sample(prompt="q", tokens=[5, 6], response="a", response_length=1, loss_mask=[1])])
    views = board.latest("a")["samples"]
    assert (views[0]["agent_turns"], views[0]["agent_branches"]) == (
        3, [{"turn": 2, "reason": "continues turn 0, not the last turn 1"}])
    assert (views[1]["agent_turns"], views[1]["agent_branches"]) == (None, [])


def test_the_board_keeps_each_jobs_latest_rollout_and_forgets_the_oldest_job(model_dir):
    board = SampleBoard(max_jobs=2)
    sample = Sample(prompt="1+2=", tokens=[5, 6, 7], response="3", response_length=1, loss_mask=[1], reward=0.5,
                    weight_versions=["3", "2", "3"], status=Status.COMPLETED)
    board.record("a", 0, [sample])
    board.record("a", 1, [sample, sample])
    record = board.latest("a")
    assert (record["rollout_id"], record["num_samples"], len(record["samples"])) == (1, 2, 2)
    view = record["samples"][0]
    assert (view["prompt"], view["response"], view["reward"], view["weight_versions"], view["status"]) == \
        ("1+2=", "3", 0.5, ["2", "3"], "COMPLETED")
    board.record("b", 0, [sample])
    board.record("c", 0, [sample])
    assert board.latest("a") is None and board.latest("c")["rollout_id"] == 0


def test_a_samples_images_show_as_thumbnails_beside_its_text_marked_where_they_stand(monkeypatch):
    """A group's images become PNG thumbnails (the longer side at most THUMBNAIL_PIXELS, the aspect kept), made once for
    the group; each image part of the prompt's messages reads [image k]."""
    import base64
    import io

    from PIL import Image as PILImage

    from services.common.samples import Image
    from services.trainer.driver import sample_board

    def png(size, colour) -> Image:
        out = io.BytesIO()
        PILImage.new("RGB", size, colour).save(out, format="PNG")
        return Image(data=out.getvalue(), mime_type="image/png", width=size[0], height=size[1])

    images = [png((400, 200), (200, 0, 0)), png((30, 60), (0, 0, 200))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "which colour?"}]}]
    group = [Sample(prompt="which colour?", prompt_messages=messages, images=images, response="red", response_length=1,
                    loss_mask=[1], group_index=0, index=i) for i in range(3)]
    made = []
    monkeypatch.setattr(sample_board, "thumbnail", lambda image, real=sample_board.thumbnail: made.append(image)
                        or real(image))
    board = SampleBoard()
    board.record("vlm", 0, group)
    view = board.latest("vlm")["samples"][2]
    assert len(made) == 2  # once per image of the group, not per sample
    assert view["prompt_messages"] == [{"role": "user", "content": "[image 1]and[image 2]which colour?"}]
    decoded = []
    for url in view["images"]:
        assert url.startswith("data:image/png;base64,")
        with PILImage.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as thumb:
            decoded.append((thumb.format, thumb.size, thumb.convert("RGB").getpixel((0, 0))))
    assert decoded == [("PNG", (160, 80), (200, 0, 0)), ("PNG", (30, 60), (0, 0, 200))]
    noisy = PILImage.effect_noise((300, 300), 80).convert("RGB")  # more detail than a photo: a PNG of it is big
    noise, small_png = io.BytesIO(), io.BytesIO()
    noisy.save(noise, format="PNG")
    noisy.resize((160, 160)).save(small_png, format="PNG")
    photo = sample_board.thumbnail(Image(data=noise.getvalue(), mime_type="image/png", width=300, height=300))
    assert photo.startswith("data:image/jpeg;base64,") and len(photo) < 4 / 3 * small_png.tell() / 2


def test_the_log_tail_picks_a_jobs_lines_by_its_record_or_its_message():
    tail = LogTail(max_lines=3)
    log = logging.getLogger("test.dashboard.logtail")
    log.addHandler(tail)
    log.setLevel(logging.INFO)
    try:
        log.info("job j1 rollout 0: reward 0.5")
        log.info("job j2 rollout 0: reward 0.1")
        log.info("loaded", extra={"job_id": "j1"})
        log.info("job j1 rollout 1: reward 0.6")
    finally:
        log.removeHandler(tail)
    lines = tail.tail("j1", 10)  # the first line fell out of the ring of 3
    assert [line.split(": ", 1)[1] for line in lines] == ["loaded", "job j1 rollout 1: reward 0.6"]
    assert tail.tail("j1", 1)[0].endswith("job j1 rollout 1: reward 0.6")


def test_checkpoints_are_listed_newest_first_with_the_one_in_force(tmp_path):
    from services.trainer.checkpoint.iterations import LATEST_FILE, iteration_dir
    from services.trainer.dashboard.api import checkpoints_of

    for rollout_id in (0, 1, 2):
        iteration_dir(tmp_path, rollout_id).mkdir()
    (tmp_path / LATEST_FILE).write_text("1")  # rollout 2's save was cut short: 1 is in force
    (tmp_path / "iter_notes").mkdir()
    info = checkpoints_of(str(tmp_path))
    assert [c["rollout_id"] for c in info["checkpoints"]] == [2, 1, 0] and info["latest"] == 1
    assert checkpoints_of("")["checkpoints"] == [] and checkpoints_of(str(tmp_path / "none"))["latest"] is None
