"""The LoRA half of bench/weight_sync.py: a full weight sync against a LoRA job's adapter-only sync, over the delta
half's link (trainer and one bf16 CPU engine in two network namespaces, 1 Gbit/s each way).

The model is the Qwen3-0.6B shape (28 layers, hidden 1024, 151936-token vocabulary; 0.6 B parameters, 1.2 GB in
bf16), randomly initialized. Each round `WeightBroadcaster` sends the weights in full (`broadcast`: pause, buckets of
update_weights_from_distributed, continue), then a rank-16 adapter on all seven projections of every layer
(`broadcast_adapter`: pause, one load_lora_adapter_from_distributed, continue), both in bf16 over the same group;
the best of each counts. Needs root; run through bench/weight_sync.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._delta_link import LINK_RATE, TIMEOUT_S, over_link  # noqa: E402

__all__ = ["LINK_RATE", "RANK", "measure"]

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128)
RANK = 16
LORA_NAME = "bench-job"
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def build_model(work: Path) -> Path:
    """The Qwen3-0.6B shape, random bf16 weights, with the tiny model's tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from physarum import tasks, tinymodel
    from services.trainer.checkpoint.hf_files import TOKENIZER_FILES, copy_side_files

    tiny = tinymodel.build_tiny_model(work / "lora-tokenizer", tasks.corpus())
    config = AutoConfig.from_pretrained(tiny)
    for key, value in QWEN3_0_6B.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * QWEN3_0_6B["num_hidden_layers"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = work / "lora-model"
    model.save_pretrained(out)
    copy_side_files(tiny, out, TOKENIZER_FILES)
    return out


def adapter_tensors(model_dir: Path) -> list:
    """A rank-16 adapter on every projection, under PEFT's names: A [r, in], B [out, r] (fp32, as trained)."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    q_out, kv_out = heads * config["head_dim"], kv * config["head_dim"]
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
              "o_proj": (q_out, hidden), "gate_proj": (hidden, config["intermediate_size"]),
              "up_proj": (hidden, config["intermediate_size"]), "down_proj": (config["intermediate_size"], hidden)}
    out = []
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                module = f"base_model.model.model.layers.{layer}.{block}.{name}"
                out += [(f"{module}.lora_A.weight", torch.randn(RANK, fan_in) * 0.01),
                        (f"{module}.lora_B.weight", torch.randn(fan_out, RANK) * 0.01)]
    return out


def trainer(url: str, master_address: str, model_dir: str, rounds: int) -> dict:
    """In the trainer's pod: `rounds` of one full sync and one adapter sync; every time of each."""
    from safetensors.torch import load_file

    from bench._delta_link import wait_healthy
    from services.trainer.weight_sync.weight_sync import WeightBroadcaster

    full = sorted((k, v.clone()) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()
                  if k != "lm_head.weight")  # tied: the embedding
    adapter = adapter_tensors(Path(model_dir))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2.0 * RANK,
              "target_modules": sorted(n for names in PROJECTIONS.values() for n in names)}
    wait_healthy(url)
    result: dict = {"full_seconds": [], "lora_seconds": []}
    with WeightBroadcaster([url], master_address=master_address, timeout_s=TIMEOUT_S) as sync:
        sync.broadcast_adapter(adapter, "warmup", lora_name=LORA_NAME, config=config)  # joins the group
        for i in range(rounds):
            start = time.perf_counter()
            stats = sync.broadcast(full, f"full-{i}")
            result["full_seconds"].append(time.perf_counter() - start)
            result["full_bytes"] = stats["bytes"]
            start = time.perf_counter()
            stats = sync.broadcast_adapter(adapter, f"lora-{i}", lora_name=LORA_NAME, config=config)
            result["lora_seconds"].append(time.perf_counter() - start)
            result["lora_bytes"] = stats["bytes"]
    return result


def measure(work: Path, rounds: int) -> dict:
    """The model, then the two pods and the trainer's rounds; its figures, or {"skipped": reason} without netns."""
    from testkit import netns

    reason = netns.unavailable_reason()
    if reason:
        return {"skipped": f"network namespaces: {reason}"}
    start = time.monotonic()
    model = build_model(work)
    print(f"lora bench: 0.6B-shaped model in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return over_link(work, model, ["--enable-lora", "true", "--max-lora-rank", str(RANK)], __file__,
                     [str(model), str(rounds)])


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--trainer":
        import logging

        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
        import torch

        torch.set_num_threads(1)
        url, address, model_path, num_rounds, _engine_pid, out_path = sys.argv[2:8]
        Path(out_path).write_text(json.dumps(trainer(url, address, model_path, int(num_rounds))))
        sys.exit(0)
    sys.exit("run through bench/weight_sync.py")
