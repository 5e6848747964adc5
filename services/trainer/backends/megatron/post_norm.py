"""A row-parallel linear layer followed by an RMSNorm of its (reduced) output: GLM-4's norms after attention and
after the MLP, before each residual add, which megatron-core's transformer layer has no place for. Under sequence
parallelism the norm sees this rank's slice of the tokens (its gradient summed over TP, as the other norms')."""

from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear

from services.trainer.backends.megatron.norm import SequenceParallelRMSNorm


class PostNormRowParallelLinear(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = SequenceParallelRMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None:  # the norm comes after the bias (GLM-4 has none)
            output, bias = output + bias, None
        return self.post_norm(output), bias
