"""The trainer's settings of a job, one module per part: training (the algorithm and optimizer), the driver, the
weight sync, slime's arguments. Torch-free: a spec is checked against them at submit."""
