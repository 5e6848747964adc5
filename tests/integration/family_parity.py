"""The shared half of the megatron family parity tests (test_megatron_gated_delta_net.py, test_megatron_moe_families.py,
the four-rank expert-TP one): what their workers' gloo ranks run (a layout's GRPO rollout, a rollout under routing
replay, the loop over the models that writes OUT/results.json), and what the tests hold it to (the fsdp backend's run
of the same model, log-prob by log-prob and step by step)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout

REPLAY_SETTINGS = ("use_routing_replay", "use_rollout_routing_replay")


def clean(metrics: list[dict]) -> list[dict]:
    """A rollout's step metrics without the timings (perf/*), which no two runs share."""
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest difference between two rollouts' per-sample log-probs (response-aligned lists)."""
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def assert_steps_match(got: list[dict], want: list[dict]) -> None:
    """Two steps each, every metric of each equal within 1e-5."""
    assert len(got) == len(want) == 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), step
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=1e-5, rel=1e-5), (step, key)


def assert_layout_run_matches(run: dict, want: dict) -> None:
    """A layout's run against the fsdp backend's: the log-probs before, the two steps, the log-probs after."""
    assert max_diff(run["log_probs_before"], want["log_probs_before"]) <= 1e-5
    assert_steps_match(run["metrics"], want["metrics"])
    assert abs(run["metrics"][1]["train/ppo_kl"]) > 1e-4  # the second step saw the policy the first one moved
    assert max_diff(run["log_probs_after"], want["log_probs_after"]) < 1e-4


def assert_replay_run_matches(got: dict, reference: dict, setting: str) -> None:
    """A run under routing replay `setting` against the fsdp backend's (`reference`: its runs of the family)."""
    want = reference[setting]
    assert_steps_match(got["metrics"], want["metrics"])
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) < 1e-4
    if setting == "use_rollout_routing_replay":  # the engine's other routing changed the step
        plain = reference["metrics"][0]["train/grad_norm"]
        assert abs(want["metrics"][0]["train/grad_norm"] - plain) > 1e-3


def assert_resumed_as_never_stopped(run: dict) -> None:
    """A backend resumed from a dist-checkpoint trained the second rollout as the one that saved it did."""
    assert len(run["resumed_metrics"]) == len(run["second_metrics"]) == 2
    for got, want in zip(run["resumed_metrics"], run["second_metrics"], strict=True):
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-6, rel=1e-6), key


def assert_export_holds(save_dir: Path, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF export in save_dir holds the fsdp backend's weights (`want`) under the same names, within 1e-4; returns
    what it holds."""
    from safetensors.torch import load_file

    saved = load_file(save_dir / "model.safetensors")
    assert saved.keys() == want.keys()
    for name, weight in want.items():
        torch.testing.assert_close(saved[name], weight, atol=1e-4, rtol=0, msg=name)
    return saved


def assert_transformers_loads(save_dir: Path, saved: dict[str, torch.Tensor]) -> None:
    """transformers loads the export in save_dir with every tensor it holds (`saved`) as it is, buffers included."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32)
    state = {**reloaded.state_dict(), **dict(reloaded.named_buffers())}
    for name, weight in saved.items():
        assert torch.equal(state[name], weight), name


def save_beside_tokenizer(model, family_dir: Path, out_dir: Path) -> Path:
    """`model` saved to out_dir with family_dir's tokenizer files (a test's variant of the tiny family model)."""
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (family_dir / name).exists():
            (out_dir / name).write_bytes((family_dir / name).read_bytes())
    return out_dir


def torch_reference(model_dirs: dict[str, Path], replayed: Sequence[str]) -> dict:
    """TorchBackend's (the HF model's) log-probs before and after the rollout, metrics and weights, per family; and
    for the `replayed` families under each routing replay setting."""
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.settings.train import TrainConfig
    from tests.integration.megatron_moe_worker import engine_routed

    out = {}
    for family, model_dir in model_dirs.items():
        backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG), num_threads=1)
        rollout = grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0)
        before = backend.compute_log_probs(rollout)
        metrics = clean(backend.train_rollout(rollout))
        out[family] = {"log_probs_before": before, "metrics": metrics,
                       "log_probs_after": backend.compute_log_probs(rollout), "weights": dict(backend.named_weights())}
        for setting in REPLAY_SETTINGS if family in replayed else ():
            backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, **{setting: True}), num_threads=1)
            rollout = engine_routed(model_dir, grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0))
            out[family][setting] = {"metrics": clean(backend.train_rollout(rollout)),
                                    "log_probs_after": backend.compute_log_probs(rollout)}
    return out


# -- the workers' ranks


def save_torch_dist(gpt, root: Path) -> None:
    """Collective: Megatron-LM's save of the model, {root}/release by dist_checkpointing.save and the latest file."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        (root / "release").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": gpt.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0},
                            str(root / "release"))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()


def layout_run(model_dir: Path, layout: dict, *, save_dir: Path | None = None, ckpt_dir: Path | None = None,
               job_id: str = "family-parity", torch_dist: bool = False) -> dict:
    """One rollout's log-probs, steps and log-probs after on MegatronBackend(**layout); save_dir: the HF export then;
    ckpt_dir: a dist-checkpoint then, a second rollout trained, and a fresh backend resumed from the checkpoint
    training it again (torch_dist: also Megatron-LM's save of the model, beside ckpt_dir, loaded as slime's --load
    into a fresh backend, whose log-probs of the first rollout come back)."""
    import torch.distributed as dist

    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), **layout)

    backend = build()
    rollout = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
    before = backend.compute_log_probs(rollout)
    metrics = clean(backend.train_rollout(rollout))
    after = backend.compute_log_probs(rollout)
    if save_dir is not None:
        backend.save_hf(save_dir)
    out = {"log_probs_before": before, "metrics": metrics, "log_probs_after": after}
    if ckpt_dir is not None:
        slime_dir = ckpt_dir.with_name(ckpt_dir.name + "-torch-dist")  # Megatron-LM's save (slime's --load)
        if torch_dist:
            save_torch_dist(backend.gpt, slime_dir)
        world = World(rank=dist.get_rank(), world_size=dist.get_world_size())
        iterations.save_checkpoint(ckpt_dir, 0, backend, world, lambda: iterations.TrainerState(
            rollout_id=0, job_id=job_id, world_size=world.world_size))
        second = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 1)
        out["second_metrics"] = clean(backend.train_rollout(second))
        backend.close()
        backend = build()
        iterations.load_checkpoint(ckpt_dir, backend, world)
        out["resumed_metrics"] = clean(backend.train_rollout(second))
        if torch_dist:
            backend.close()
            backend = build()
            backend.load_megatron_checkpoint(iterations.slime_checkpoint(slime_dir), "model")
            out["torch_dist_log_probs"] = backend.compute_log_probs(rollout)
    backend.close()
    return out


def replay_run(model_dir: Path, setting: str) -> dict:
    """One rollout at EP=2 under `setting`, routed to an engine's other experts (use_rollout_routing_replay) or to
    the experts the old policy's forward chose (use_routing_replay)."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig
    from tests.integration.megatron_moe_worker import engine_routed

    backend = MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG, **{setting: True}), expert_model_parallel_size=2)
    rollout = engine_routed(model_dir, grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0))
    metrics = clean(backend.train_rollout(rollout))
    after = backend.compute_log_probs(rollout)
    backend.close()
    return {"metrics": metrics, "log_probs_after": after}


def run_models(rank: int, out_dir: Path, model_dirs: list[Path], runs_of: Callable[[Path], dict]) -> None:
    """A worker's rank: runs_of(model_dir) for each model (its directory's name is its family), rank 0 writing them
    all to out_dir/results.json."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    results = {model_dir.name: runs_of(model_dir) for model_dir in model_dirs}
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))


def main(run: Callable, world_size: int = 2) -> None:
    """A worker's entry: `run(rank, world_size, OUT, MODEL_DIRS)` on `world_size` gloo ranks from `python -m worker
    OUT MODEL_DIR...`."""
    from bench.megatron_parity import spawn

    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    spawn(run, Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]], world_size=world_size,
          start_method="spawn" if torch.cuda.is_available() else "fork")
