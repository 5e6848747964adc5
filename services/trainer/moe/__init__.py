"""Mixture-of-experts bookkeeping: the load-balancing loss, and routing replay on transformers' MoE layers and on
megatron-core's routers."""
