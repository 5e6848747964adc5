"""Settings of the CPU engine: where it listens, which Hugging Face model directory it serves, batching, RNG, and
the latency-controlled and fake-compute modes of tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import field


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    host: str = field("127.0.0.1", "address the HTTP server binds")
    port: int = field(30000, "HTTP port (SGLang's default; 0 picks a free port)")
    model_path: str = field("", "Hugging Face model directory (config.json, safetensors, tokenizer); required")
    served_model_name: str = field("", "name reported by /model_info (default: model_path)")
    max_batch_size: int = field(64, "most requests decoded together in one batch")
    num_threads: int = field(1, "torch intra-op threads")
    seed: int = field(0, "seed of the engine's RNG, used by requests without a sampling_seed")
    weight_version: str = field("default", "initial weight_version reported in meta_info and /model_info")
    weight_sync_timeout_s: float = field(60.0, "timeout of the weight-update process group and of update calls")
    device: str = field("cpu", "where the model runs: cpu, or cuda (one CUDA device; sampling stays on the host)")
    dtype: str = field("float32", "dtype the model is served in: float32 or bfloat16 (the trainer sends weights in "
                                  "it)")
    per_token_delay_s: float = field(0.0, "extra seconds per decode step: sets the latency of tests and benchmarks")
    fake_compute: bool = field(False, "no model and no torch: random tokens with SGLang's reply shapes, for control-"
                               "plane tests and benchmarks of many engines (weights: update_weights_from_disk only)")

    enable_lora: bool = field(False, "serve LoRA adapters over the base model (SGLang's --enable-lora): "
                              "/load_lora_adapter, /unload_lora_adapter, a request's lora_path")
    max_loras_per_batch: int = field(8, "most distinct adapters in one batch, the base model (no adapter) counting "
                                        "as one (SGLang's)")
    max_lora_rank: int = field(0, "largest adapter rank accepted (0: any)")
    lora_target_modules: list[str] = field([], "the Linear layers that can take an adapter, by name or dotted "
                                               "suffix (empty or all: every Linear of the language model but "
                                               "lm_head)")
    lora_paths: list[str] = field([], "adapters to load at start: NAME=PATH or PATH (a PEFT adapter directory)")

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required: --model-path DIR (a Hugging Face model directory)")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path must be a Hugging Face model directory with config.json, "
                             f"got {self.model_path!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_batch_size", "num_threads", "max_loras_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.per_token_delay_s < 0:
            raise ValueError(f"per_token_delay_s must be >= 0, got {self.per_token_delay_s}")
        if self.max_lora_rank < 0:
            raise ValueError(f"max_lora_rank must be >= 0, got {self.max_lora_rank}")
        if (self.lora_paths or self.lora_target_modules) and not self.enable_lora:
            raise ValueError("lora_paths and lora_target_modules need enable_lora (--enable-lora true)")
        if self.enable_lora and self.fake_compute:
            raise ValueError("enable_lora needs a model: fake_compute runs none")
        if self.weight_sync_timeout_s <= 0:
            raise ValueError(f"weight_sync_timeout_s must be > 0, got {self.weight_sync_timeout_s}")
