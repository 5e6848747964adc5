"""A rollout's samples as the tensors a backend trains on: the padded batch, the packed micro-batch row, which
samples each optimizer step and micro-batch hold, and causal attention over a packed row."""
