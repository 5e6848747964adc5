"""The megatron-core backend: GPTModel with TP × PP × DP, Megatron DDP and distributed optimizer, HF conversion.

Nothing here imports megatron at package import (it costs ~6 s); `backend.MegatronBackend` loads it when built.
"""
