"""LoRA adapters on the fsdp backend: the layers (`layers.py`) and their PEFT-format export and merge (`export.py`)."""
