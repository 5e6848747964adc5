"""The trainer's processes: a pod's launcher (`launch.py`, one rank per GPU as torchrun) and the ranks > 0's loop of
jobs (`worker.py`); rank 0 is `python -m services.trainer`."""
