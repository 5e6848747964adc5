"""The CPU inference engine: a transformers model behind SGLang's HTTP API, so it is a drop-in for SGLang on CPU.

`python -m services.engine --model-path DIR`; see reference/sglang-protocol.md §3 for the API it speaks.
"""
