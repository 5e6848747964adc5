"""iterations.py with a backend of Megatron-LM's torch_dist format: its state goes into iter_N/ itself (where slime's
--load finds it), what a load asks of it, and a checkpoint of the other format refused. (The real save/resume runs in
tests/integration/test_megatron_parity.py, the round trip through megatron-core in
tests/integration/test_megatron_slime_checkpoint.py.)"""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import World


class FakeSharded:
    """Records what iterations.py asks of a ShardedCheckpointable; its state is one file per part."""

    checkpoint_format = "torch_dist"

    def __init__(self, parts=("model", "optim", "ref_model")) -> None:
        self.parts = set(parts)
        self.calls: list[tuple] = []

    def checkpoint_parts(self) -> set[str]:
        return set(self.parts)

    def save_sharded(self, path, rollout_id=0) -> None:
        path.mkdir(parents=True)
        assert not any(path.iterdir())  # dist-checkpointing writes into an empty directory
        (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        for part in self.parts:
            (path / f"part.{part}").write_text(part)
        self.calls.append(("save", path, rollout_id))

    def load_sharded(self, path, parts=None) -> set[str]:
        saved = {p.name.removeprefix("part.") for p in path.iterdir()}
        loaded = self.parts & saved & (parts if parts is not None else saved)
        self.calls.append(("load", path, parts, loaded))
        return loaded

    def load_ref_sharded(self, path) -> None:
        self.calls.append(("load_ref", path))


def state(rollout_id: int) -> iterations.TrainerState:
    return iterations.TrainerState(rollout_id=rollout_id, job_id="j", world_size=1)


def test_a_sharded_backend_writes_and_reads_its_own_directory(tmp_path, caplog):
    saver = FakeSharded(parts=("model", "optim"))
    path = iterations.save_checkpoint(tmp_path, 3, saver, World(), lambda: state(3))
    assert saver.calls == [("save", path, 3)]
    assert sorted(p.name for p in path.iterdir()) == ["metadata.json", "part.model", "part.optim", "rng_rank0.pt",
                                                     "trainer_state.json"]
    assert iterations.latest_iteration(tmp_path) == 3

    loader = FakeSharded()  # has a reference model the checkpoint lacks: it keeps its own
    assert iterations.load_checkpoint(tmp_path, loader, World()).rollout_id == 3
    assert loader.calls == [("load", path, None, {"model", "optim"})]
    assert "has no ref_model; keeping the current ones" in caplog.text
    iterations.load_reference(tmp_path, loader, World())
    assert loader.calls[-1] == ("load_ref", path)


def test_a_checkpoint_of_the_other_format_is_refused_by_name(tmp_path):
    iteration = iterations.iteration_dir(tmp_path, 0)
    (iteration / "dcp").mkdir(parents=True)
    (iteration / iterations.STATE_FILE).write_text('{"rollout_id": 0, "job_id": "j", "world_size": 1}')
    (tmp_path / iterations.LATEST_FILE).write_text("0\n")
    with pytest.raises(InvalidArgument, match=r"holds dcp/, written by another train_backend \(or an earlier "
                                              r"Physarum\); this job's backend reads torch_dist files in iter_N/ "
                                              r"itself"):
        iterations.load_checkpoint(tmp_path, FakeSharded(), World())
    with pytest.raises(InvalidArgument, match="written by another train_backend"):
        iterations.load_reference(tmp_path, FakeSharded(), World())
    iterations.save_checkpoint(tmp_path / "megatron", 0, FakeSharded(), World(), lambda: state(0))
    dcp_backend = FakeSharded()
    dcp_backend.checkpoint_format = "dcp"
    with pytest.raises(InvalidArgument, match=r"holds torch_dist files, .* this job's backend reads dcp/"):
        iterations.load_checkpoint(tmp_path / "megatron", dcp_backend, World())


def test_slimes_layout_is_told_from_physarums(tmp_path):
    """slime's (Megatron-LM's) torch_dist root: the latest file holds `release` or an iteration, whose directory
    holds dist-checkpointing's files itself; Physarum's iter_N/ holds trainer_state.json and a backend directory."""
    release = tmp_path / "slime"
    (release / "release").mkdir(parents=True)
    (release / "release" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (release / iterations.LATEST_FILE).write_text("release")
    assert iterations.slime_checkpoint(release) == release / "release"
    (release / "iter_0000007").mkdir()
    (release / "iter_0000007" / "metadata.json").write_text("{}")
    assert iterations.slime_checkpoint(release, 7) == release / "iter_0000007"  # --ckpt-step
    assert iterations.slime_checkpoint(release, 8) is None
    saver = FakeSharded(parts=("model",))
    iterations.save_checkpoint(tmp_path / "own", 2, saver, World(), lambda: state(2))
    assert iterations.slime_checkpoint(tmp_path / "own") is None
    assert iterations.slime_checkpoint(tmp_path / "nothing") is None


def test_te_and_local_norm_spellings_are_twins():
    from services.trainer.checkpoint.slime_torch_dist import _twin

    fused = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"  # Transformer Engine's
    assert _twin("decoder.layers.input_layernorm.weight") == fused
    assert _twin("decoder.layers.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.pre_mlp_layernorm.weight"
    assert _twin("decoder.layers.mlp.linear_fc1.weight") is None


def test_ref_ckpt_step_picks_the_reference_checkpoint(tmp_path):
    saver = FakeSharded(parts=("model",))
    for rollout_id in (2, 3):
        iterations.save_checkpoint(tmp_path, rollout_id, saver, World(), lambda r=rollout_id: state(r))
    loader = FakeSharded()
    iterations.load_reference(tmp_path, loader, World(), 2)  # slime's --ref-ckpt-step
    assert loader.calls[-1] == ("load_ref", iterations.iteration_dir(tmp_path, 2))
    iterations.load_reference(tmp_path, loader, World())
    assert loader.calls[-1] == ("load_ref", iterations.iteration_dir(tmp_path, 3))


def test_a_torch_dist_checkpoint_also_writes_slimes_data_source_state(tmp_path):
    """slime's --load of the save root reads rollout/global_dataset_state_dict_N.pt (a plain dict, loaded with
    torch.load): the epoch and the prompts of it trained on, those still queued (returned, leased or pending)
    handed out again."""
    import torch

    buffer = {"num_prompts": 10, "shuffle": False, "seed": 1, "epoch": 2, "cursor": 6, "returned": ["2:5"],
              "leased": ["1:9"], "pending": ["2:4"], "rollout_id": 3}
    iterations.save_checkpoint(tmp_path, 3, FakeSharded(), World(), lambda: iterations.TrainerState(
        rollout_id=3, job_id="j", world_size=1, buffer=buffer))
    data_state = torch.load(tmp_path / "rollout" / "global_dataset_state_dict_3.pt", weights_only=True)
    assert data_state == {"sample_offset": 4, "epoch_id": 2, "sample_group_index": 24, "metadata": {}}
    assert iterations.load_checkpoint(tmp_path, FakeSharded(), World()).buffer == buffer  # Physarum's own, whole
    dcp_backend = FakeSharded()
    dcp_backend.checkpoint_format = "dcp"  # Physarum's other layout: slime does not read it, nothing for it
    iterations.save_checkpoint(tmp_path / "dcp", 3, dcp_backend, World(), lambda: iterations.TrainerState(
        rollout_id=3, job_id="j", world_size=1, buffer=buffer))
    assert not (tmp_path / "dcp" / "rollout").exists()
