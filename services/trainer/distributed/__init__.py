"""The trainer's ranks as one torch.distributed world: the process group and its collectives, each rank's device and
precision, and megatron-core's CUDA-only calls made to run on the CPU."""
