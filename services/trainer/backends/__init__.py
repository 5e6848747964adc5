"""Training backends behind one Protocol (`base.TrainBackend`): `fsdp/` (an HF model under torch FSDP2) and
`megatron/` (megatron-core), each registering its builder with `registry`; what each can do is `capabilities.py`,
which backend a job uses and how its ranks are laid out `layout.py`.

Importing this package loads neither torch nor transformers.
"""
