"""Distributed plumbing of the trainer's ranks: the process group and its collectives, each rank's device, and the
Hugging Face side files a checkpoint carries."""
