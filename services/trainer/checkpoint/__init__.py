"""Every save, load, conversion and on-disk weight format of the trainer: a job's checkpoint iterations (slime's
layout), torch.distributed.checkpoint and its safe reader, the torch backend's state, Megatron-LM's torch_dist (the
Megatron backend's and slime's), HF safetensors directories and their side files, HF <-> Megatron weights."""
