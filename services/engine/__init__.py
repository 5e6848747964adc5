"""The CPU inference engine: a transformers model behind SGLang's HTTP API, so it is a drop-in for SGLang on CPU.

`python -m services.engine --model-path DIR`; server.py lists the SGLang endpoints it speaks.
"""
