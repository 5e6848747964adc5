"""The CPU engine serving LoRA adapters (SGLang's --enable-lora API) as a real process: adapters loaded from PEFT
directories the trainer's export writes and from the weight sync's push, several in one batch, each request's output
equal to the trainer's merged model's (float32); unload; the errors that name what is wrong."""

from __future__ import annotations

import httpx
import pytest

from services.trainer.lora import export as lora_export
from services.trainer.weight_sync.weight_sync import AdapterPush, WeightBroadcaster, write_adapter_snapshot
from tests.integration.lora_adapters import (
    PROMPTS,
    TARGETS,
    adapter_tensors,
    assert_rows_match,
    expected,
    generate_rows,
    lora_engine,
    lora_state,
    merged_model,
    peft_config,
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, session_dir):
    yield from lora_engine(tiny_model_dir, session_dir / "test_engine_lora", max_loras=2,
                           target_modules="q_proj,k_proj,v_proj,down_proj", weight_sync_timeout_s=30)


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two adapters (rank 4 and rank 2) as PEFT directories, with their trainer states."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, rank, seed in (("alpha", 4, 1), ("beta", 2, 2)):
        state = lora_state(tiny_model_dir, rank=rank, seed=seed)
        lora_export.save_peft_adapter(root / name, state, rank=rank, alpha=2.0 * rank, dropout=0.0,
                                      target_modules=TARGETS, base_model=str(tiny_model_dir))
        out[name] = (root / name, state)
    return out


def test_load_from_peft_dirs_and_serve_several_adapters_in_one_batch(http, adapters, tiny_model_dir):
    for name, (path, _) in adapters.items():
        reply = http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == 200, reply.text
        assert reply.json()["success"] is True and name in reply.json()["loaded_adapters"]
    assert http.post("/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(adapters["alpha"][0])}
                     ).status_code == 400  # a name already loaded: unload first, as SGLang
    models = {name: merged_model(tiny_model_dir, state) for name, (_, state) in adapters.items()}
    base = merged_model(tiny_model_dir, None)
    # three rows, three adapters (the base counting as one) over max_loras_per_batch 2: batches split, same outputs
    rows = generate_rows(http, ["alpha", "beta", None])
    assert_rows_match(rows, [models["alpha"], models["beta"], base])
    base_logprobs = expected(base, PROMPTS[0])[1]
    adapted = [entry[0] for entry in rows[0]["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(adapted, base_logprobs, strict=True)) > 1e-2  # the adapter shows
    assert_rows_match(generate_rows(http, "beta"), [models["beta"]] * 3)  # one name for every prompt


def test_the_weight_syncs_adapter_push_replaces_the_adapter(http, engine, adapters, tiny_model_dir):
    state = lora_state(tiny_model_dir, rank=4, seed=3)  # the next version of "alpha"
    with WeightBroadcaster([engine], timeout_s=30.0) as broadcaster:
        stats = broadcaster.broadcast_adapter(adapter_tensors(state), "7", lora_name="alpha", config=peft_config(4))
    assert stats["num_tensors"] == 2 * 3 * 2  # A and B of 3 modules in each of the tiny model's 2 layers
    rows = generate_rows(http, ["alpha", "alpha", "beta"])
    assert_rows_match(rows, [merged_model(tiny_model_dir, state)] * 2 + [merged_model(tiny_model_dir,
                                                                                      adapters["beta"][1])])
    assert [row["meta_info"]["weight_version"] for row in rows] == ["7", "7", "default"]  # each adapter's own


def test_a_joining_engine_loads_the_adapter_snapshot_from_disk(http, tiny_model_dir, tmp_path):
    state = lora_state(tiny_model_dir, rank=4, seed=4)
    snapshot = write_adapter_snapshot(adapter_tensors(state), tmp_path, "9",
                                      AdapterPush("alpha", peft_config(4)))
    reply = http.post("/update_weights_from_disk", json={"model_path": snapshot, "weight_version": "9"})
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    rows = generate_rows(http, "alpha")
    assert_rows_match(rows, [merged_model(tiny_model_dir, state)] * 3)
    assert {row["meta_info"]["weight_version"] for row in rows} == {"9"}


def test_unload_and_the_errors_that_name_the_adapter(http, adapters, tmp_path):
    reply = http.post("/unload_lora_adapter", json={"lora_name": "beta"})
    assert reply.status_code == 200 and "beta" not in reply.json()["loaded_adapters"], reply.text
    reply = http.post("/generate", json={"input_ids": [5, 6], "lora_path": "beta"})
    assert reply.status_code == 400 and "'beta' names no loaded LoRA adapter" in reply.text
    assert http.post("/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 400
    big = tmp_path / "big"
    lora_export.save_peft_adapter(big, {}, rank=16, alpha=16.0, dropout=0.0, target_modules=TARGETS, base_model="")
    reply = http.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert reply.status_code == 400 and "rank 16 is over --max-lora-rank 8" in reply.json()["error_message"]
    reply = http.post("/load_lora_adapter", json={"lora_name": "none", "lora_path": str(tmp_path / "missing")})
    assert reply.status_code == 400 and "adapter_config.json" in reply.json()["error_message"]


def test_an_engine_without_enable_lora_refuses_lora_path(cpu_engine_url):
    reply = httpx.post(f"{cpu_engine_url}/generate", json={"input_ids": [5, 6], "lora_path": "alpha"}, timeout=60)
    assert reply.status_code == 400 and "--enable-lora" in reply.text
