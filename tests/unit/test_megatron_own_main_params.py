"""Float32 weights under megatron-core's distributed optimizer are their own main parameters (`own_main_params.py`):
every shard it steps is the memory its parameter buffer's copy would write, so the copy after a step is skipped and
the step still moves the weights; bf16 weights (float32 main copies) keep megatron-core's copy."""

from __future__ import annotations

import torch
from torch.profiler import profile

from services.trainer.distributed import megatron_cpu
from services.trainer.settings.train import TrainConfig
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout


def test_float32_shards_alias_the_buffers_and_bf16_ones_do_not(tiny_model_dir):
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.backends.megatron.own_main_params import main_params_are_model_params

    for bf16, aliased in ((False, True), (True, False)):
        backend = MegatronBackend(tiny_model_dir, TrainConfig(**{**GRPO_CONFIG, "bf16": bf16}), num_threads=1)
        try:
            samples = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, 0)
            before = [p.detach().float().clone() for p in backend.gpt.parameters()]
            backend.train_rollout(samples)
            optimizer = backend.optimizer.chained_optimizers[0]
            assert main_params_are_model_params(optimizer) is aliased, bf16
            with profile() as prof, megatron_cpu.cuda_to_cpu():
                optimizer._copy_main_params_to_model_params()
            copies = sum(event.name == "aten::copy_" for event in prof.events())
            assert (copies == 0) if aliased else (copies >= len(before)), (bf16, copies)
            after = [p.detach().float() for p in backend.gpt.parameters()]
            assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), bf16  # the step moved them
        finally:
            backend.close()
