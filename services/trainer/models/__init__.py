"""The model families each backend builds (asked at submit, torch-free) and an HF model's architecture as the few
numbers Megatron and the weight converter need."""
