"""MegatronBackend's weights in HF form: HF checkpoints (and slime's torch_dist ones) loaded into the policy, the
reference or the distillation teacher, converted to each rank's shards (`megatron_convert`); and the policy's
weights out as HF tensors, gathered from the shards."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.errors import InvalidArgument
from services.trainer.checkpoint import hf_io, megatron_convert, slime_torch_dist
from services.trainer.models.arch import ModelArch

log = logging.getLogger(__name__)


class MegatronHFWeights:
    """Mixin of MegatronBackend (its gpt, ref_model, teacher_model, arch, ranks and optimizer are the backend's)."""

    def _frozen_copy(self, hf: hf_io.HFTensors):
        gpt = self._build_gpt().requires_grad_(False)
        self._copy_hf_weights(gpt, hf)
        return gpt

    def _copy_hf_weights(self, gpt, hf: hf_io.HFTensors, *, output_layer: bool = True) -> None:
        """output_layer False: all but the output layer (the critic's is its own value head)."""
        state = megatron_convert.hf_to_megatron(hf, self.arch, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                                pp_rank=self.pp_rank, pp_size=self.pp_size, te_names=self.use_te,
                                                ep_rank=self.ep_rank, ep_size=self.ep_size,
                                                etp_rank=self.etp_rank, etp_size=self.etp_size)
        params = dict(megatron_convert.weights(gpt))
        if not output_layer:
            state.pop("output_layer.weight", None)
            params.pop("output_layer.weight", None)
        assert params.keys() == state.keys(), f"conversion mismatch: {sorted(params.keys() ^ state.keys())}"
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])

    def load(self, path: str | Path) -> None:
        """Replace the policy's weights with an HF checkpoint's (same architecture), with fresh optimizer state."""
        self._load_hf(self.gpt, Path(path), "model")
        self.optimizer = self._build_optimizer()
        self._num_steps = 0

    def load_ref(self, path: str | Path) -> None:
        """Replace the reference model's weights with an HF checkpoint's (slime's --ref-load)."""
        if self.ref_model is None:
            raise InvalidArgument("ref_load: this job has no reference model (use_kl_loss or kl_coef)")
        self._load_hf(self.ref_model, Path(path), "ref_load")

    def load_teacher(self, path: str | Path) -> None:
        """Replace the distillation teacher's weights with an HF checkpoint's (slime's --opd-teacher-load)."""
        if self.teacher_model is None:
            raise InvalidArgument("opd_teacher_load: this job has no teacher model (use_opd with opd_type megatron)")
        self._load_hf(self.teacher_model, Path(path), "opd_teacher_load")

    def load_megatron_checkpoint(self, path: str | Path, into: str) -> None:
        """Collective: a slime torch_dist directory's weights into the policy (with a fresh optimizer), the
        reference or the teacher (`slime_torch_dist`)."""
        target = {"model": self.gpt, "ref_model": self.ref_model, "teacher": self.teacher_model}[into]
        if target is None:
            raise InvalidArgument(f"checkpoint {path}: this job has no {into} to load it into")
        slime_torch_dist.load_model(target, path, self.arch)
        if into == "model":
            self.optimizer = self._build_optimizer()
            self._num_steps = 0

    def _load_hf(self, gpt, path: Path, what: str) -> None:
        """An HF checkpoint of the policy's architecture into one of the models (slime swaps such weights into its one
        model, so it needs the same architecture too)."""
        hf_config = hf_io.read_config(path)
        arch = ModelArch.from_hf_config(hf_config)
        if self.arch.vision_model_type and not arch.vision_model_type:  # Qwen3.5 loaded for a job with images
            arch = arch.with_vision(hf_config)
        arch = dataclasses.replace(arch,  # the job's, not the file's
                                   stage_layers=self.arch.stage_layers, mtp_num_layers=self.arch.mtp_num_layers,
                                   vocab_size_divisible_by=self.arch.vocab_size_divisible_by)
        if arch != self.arch:
            raise InvalidArgument(f"{what} {path}: architecture {arch} differs from the policy's {self.arch}")
        self._copy_hf_weights(gpt, hf_io.HFTensors(path))

    def update_ref_model(self) -> None:
        """Copy the policy into the reference model (slime's --ref-update-interval), shard by shard."""
        with torch.no_grad():
            for (name, param), (ref_name, ref) in zip(megatron_convert.weights(self.gpt),
                                                      megatron_convert.weights(self.ref_model), strict=True):
                assert name == ref_name, (name, ref_name)
                ref.copy_(param)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every rank must run it to the end. Global rank 0 yields each HF weight once (a tied
        lm_head comes as model.embed_tokens.weight only); the other ranks yield nothing."""
        yield from megatron_convert.gather_hf_weights(
            megatron_convert.weights(self.gpt), self.arch, tp_group=self.tp_group, tp_rank=self.tp_rank,
            tp_size=self.tp_size, pp_group=self.pp_group, pp_rank=self.pp_rank, pp_size=self.pp_size,
            dp_rank=self.dp_cp_rank, ep_group=self.ep_group, ep_size=self.ep_size, expert_dp_rank=self.expert_dp_rank,
            etp_size=self.etp_size, etp_group=self.etp_group)

    def save_hf(self, path: str | Path) -> None:
        """Collective: rank 0 writes the HF checkpoint directory."""
        path = Path(path)
        weights = dict(self.named_weights())
        if dist.get_rank() == 0:
            hf_io.write_checkpoint(path, weights, self.model_path)
            log.info("saved HF checkpoint to %s", path)
        dist.barrier()
