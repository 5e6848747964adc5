"""Paths checked when they are written: a save directory swapped for a symlink out of the roots after submit is
refused at the write, a symlink at a dump's file name is refused (O_NOFOLLOW), and the trainer's writers go through
the check."""

from __future__ import annotations

import os

import pytest

from services.common import write_roots
from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.checkpoint import iterations as checkpoint


@pytest.fixture
def roots(tmp_path):
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    write_roots.configure([str(inside)], [str(inside)])
    yield inside, outside
    write_roots.configure([], [])


def test_a_directory_swapped_for_a_link_out_of_the_roots_is_refused_at_write(roots):
    inside, outside = roots
    save = inside / "ckpt"
    assert write_roots.writable_dir(save, write_roots.CHECKPOINTS, "save") == save.resolve()  # as at submit
    save.rmdir()
    save.symlink_to(outside)  # while the job waited in the queue
    with pytest.raises(InvalidArgument, match="save .* lies outside"):
        write_roots.writable_dir(save, write_roots.CHECKPOINTS, "save")
    with pytest.raises(InvalidArgument, match="save .* lies outside"):
        write_roots.writable_dir(save / "iter_0000001", write_roots.CHECKPOINTS, "save")
    assert not list(outside.iterdir())
    inner = inside / "other"
    inner.mkdir()
    (inside / "inner-link").symlink_to(inner)  # a link that stays inside is fine
    assert write_roots.writable_dir(inside / "inner-link" / "x", write_roots.CHECKPOINTS, "save") == inner / "x"


def test_a_link_at_a_dumps_file_name_is_refused_not_followed(roots):
    inside, outside = roots
    target = inside / "target.pt"
    target.write_bytes(b"keep")
    (inside / "0.pt").symlink_to(target)
    with pytest.raises(InvalidArgument, match="cannot be written"):
        checkpoint.save_debug_rollout_data(str(inside / "{rollout_id}.pt"), 0, [Sample(prompt="p", response="r")])
    assert target.read_bytes() == b"keep"
    (inside / "dumps").symlink_to(outside)
    with pytest.raises(InvalidArgument, match="save_debug_rollout_data .* lies outside"):
        checkpoint.save_debug_rollout_data(str(inside / "dumps" / "{rollout_id}.pt"), 1, [])
    written = checkpoint.save_debug_rollout_data(str(inside / "d" / "{rollout_id}.pt"), 2,
                                                 [Sample(prompt="p", response="r")])
    assert [s.response for s in checkpoint.load_debug_rollout_data(str(inside / "d" / "{rollout_id}.pt"), 2)] == ["r"]
    assert oct(os.stat(written).st_mode & 0o777) == oct(0o600)


def test_unconfigured_roots_leave_writes_unconfined(tmp_path):
    write_roots.configure([], [])
    assert write_roots.writable_dir(tmp_path / "a" / "b", write_roots.EXPORTS, "save_hf").is_dir()
