"""lora_sync disk against the CPU engine as a real process, through SGLang's /load_lora_adapter as SGLang answers it:
each version written as PEFT's directory and loaded under its own name, served equal to the trainer's merged model
(float32); the versions advance, older ones unloaded and their directories pruned; a bad path is a 400 in SGLang's
shape that names it, and the engine serves on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from services.common.sglang import AsyncSGLangClient, serves_adapter_push
from services.rollout.client import adapter_snapshot_root
from services.rollout.pool import adapter_join
from services.trainer.weight_sync.adapter_disk import DISK_SUBDIR, AdapterSync, stale_versions
from services.trainer.weight_sync.weight_sync import (
    AdapterPush,
    WeightBroadcaster,
    WeightSyncError,
    write_adapter_snapshot,
)
from tests.integration.lora_adapters import (
    adapter_tensors,
    assert_rows_match,
    generate_rows,
    lora_engine,
    lora_state,
    merged_model,
    peft_config,
)

RANK = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir, session_dir):
    # an unload drains paused requests for up to the weight-sync timeout: a loaded machine can be slow to probe
    yield from lora_engine(tiny_model_dir, session_dir / "test_engine_lora_disk", max_loras=3,
                           target_modules="q_proj,v_proj,down_proj", weight_sync_timeout_s=120)


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def disk_sync(engine, tmp_path_factory):
    sync = AdapterSync(WeightBroadcaster([], timeout_s=30.0), lora_sync="disk",
                       disk_dir=str(tmp_path_factory.mktemp("lora-disk")), timeout_s=30.0)
    sync.set_engines([engine])
    yield sync
    sync.close()


def sync_version(sync: AdapterSync, state, version: str) -> dict:
    """One step's sync as sync_engine_pool drives it (no pool snapshot: the adapter goes to update_weight_disk_dir)."""
    served = sync.adapter_for(AdapterPush("job", peft_config(RANK)), version)
    return sync.broadcast_adapter(adapter_tensors(state), version, lora_name=served.lora_name, config=served.config)


def test_which_versions_an_engine_unloads():
    loaded = ["job@v1", "job@v2", "job@v3", "job", "other@v1", "job@vx", "job2@v1"]
    assert stale_versions(loaded, "job", "3") == ["job@v1"]  # v2: the requests name it until this sync ends
    assert stale_versions(loaded, "job", "2") == ["job@v3"]  # a trainer resumed at an earlier version
    assert stale_versions(["job@v7"], "job", "7") == []


def test_only_the_cpu_engine_takes_the_adapter_push():
    """lora_sync auto reads /server_info's `version`: SGLang's is its release."""
    assert serves_adapter_push({"version": "physarum-cpu-engine 0.1.0"})
    assert not serves_adapter_push({"version": "0.5.4.post1", "enable_lora": True})
    assert not serves_adapter_push({})


def test_auto_pushes_to_cpu_engines(engine):
    sync = AdapterSync(WeightBroadcaster([], timeout_s=30.0), lora_sync="auto", timeout_s=30.0)
    assert sync.resolve() == "auto"  # no engines asked yet
    sync.set_engines([engine])
    assert sync.adapter_for(AdapterPush("job", {}), "1").lora_name == "job" and sync.route == "push"
    sync.close()


def test_versions_advance_each_under_its_name_equal_to_the_merged_model(http, disk_sync, tiny_model_dir):
    states = {v: lora_state(tiny_model_dir, rank=RANK, seed=20 + int(v)) for v in ("1", "2", "3")}
    for version, state in states.items():
        stats = sync_version(disk_sync, state, version)
        assert stats["mode"] == "disk" and stats["num_tensors"] == 2 * 3 * 2 and stats["pause_seconds"] == 0.0
        rows = generate_rows(http, f"job@v{version}")
        assert_rows_match(rows, [merged_model(tiny_model_dir, state)] * 3)
        assert http.get("/model_info").json()["weight_version"] == version
        assert {row["meta_info"]["weight_version"] for row in rows} == {version}
    # v2 stays for the requests that still name it; v1 is unloaded, and its directory pruned
    assert_rows_match(generate_rows(http, ["job@v2", "job@v3", None]),
                      [merged_model(tiny_model_dir, states["2"]), merged_model(tiny_model_dir, states["3"]),
                       merged_model(tiny_model_dir, None)])
    reply = http.post("/generate", json={"input_ids": [5, 6], "lora_path": "job@v1"})
    assert reply.status_code == 400 and "'job@v1' names no loaded LoRA adapter" in reply.text
    published = adapter_snapshot_root(Path(disk_sync.disk_dir, DISK_SUBDIR), "job")  # the job's own snapshots
    assert sorted(p.name for p in published.iterdir()) == ["weight_v2", "weight_v3"]


def test_a_retried_sync_of_a_loaded_version_loads_it_afresh(http, disk_sync, tiny_model_dir):
    state = lora_state(tiny_model_dir, rank=RANK, seed=40)
    sync_version(disk_sync, lora_state(tiny_model_dir, rank=RANK, seed=41), "4")
    sync_version(disk_sync, state, "4")  # SGLang refuses a name already loaded: unloaded and loaded again
    assert_rows_match(generate_rows(http, "job@v4"), [merged_model(tiny_model_dir, state)] * 3)


def test_an_engine_joining_from_a_lora_snapshot_loads_its_adapters_with_sglangs_api(http, engine, tmp_path,
                                                                                   tiny_model_dir):
    """The rollout manager's join step: SGLang's /update_weights_from_disk reads no adapter directory."""
    state = lora_state(tiny_model_dir, rank=RANK, seed=8)
    snapshot = write_adapter_snapshot(adapter_tensors(state), tmp_path, "8", AdapterPush("job@v8", peft_config(RANK)))
    adapters = adapter_join.snapshot_adapters(snapshot)
    assert adapters == [("job@v8", str(Path(snapshot, "adapters", "job@v8")))]
    assert adapter_join.snapshot_adapters(str(tmp_path / "weight_v9")) == []  # a full-weight snapshot: none

    async def join() -> None:
        engines = AsyncSGLangClient(timeout_s=30.0)
        try:
            await adapter_join.load_adapters(engines, engine, adapters, "8", 30.0)
        finally:
            await engines.close()

    for _ in range(2):  # a second try finds the name loaded (SGLang refuses it): loaded afresh
        asyncio.run(join())
    rows = generate_rows(http, "job@v8")
    assert_rows_match(rows, [merged_model(tiny_model_dir, state)] * 3)
    assert {row["meta_info"]["weight_version"] for row in rows} == {"8"}


def test_a_bad_path_is_a_400_in_sglangs_shape_and_the_engine_serves_on(http, engine, disk_sync, tmp_path,
                                                                       tiny_model_dir):
    missing = tmp_path / "no-such-adapter"
    reply = http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(missing)})
    body = reply.json()
    assert reply.status_code == 400 and set(body) == {"success", "error_message", "loaded_adapters"}
    assert body["success"] is False and str(missing) in body["error_message"]
    assert "bad" not in body["loaded_adapters"] and "job@v4" in body["loaded_adapters"]  # what stays loaded
    with pytest.raises(WeightSyncError, match="no-such-adapter"):
        disk_sync.broadcast_adapter(adapter_tensors(lora_state(tiny_model_dir, rank=RANK, seed=5)), "5",
                                    lora_name="job@v5", config=peft_config(RANK), directory=str(missing))
    assert httpx.get(f"{engine}/health", timeout=30).status_code == 200
    assert len(generate_rows(http, "job@v4")) == 3
    nowhere = AdapterSync(WeightBroadcaster([], timeout_s=30.0), lora_sync="disk", timeout_s=30.0)
    nowhere.set_engines([engine])
    with pytest.raises(WeightSyncError, match="update_weight_disk_dir is not set"):
        nowhere.broadcast_adapter([], "6", lora_name="job@v6", config=peft_config(RANK))


def test_unload_lets_the_adapters_requests_finish_and_refuses_new_ones_meanwhile(http, engine, tiny_model_dir):
    """SGLang's unload: the name is refused to new requests at once, the adapter goes once its requests finish (the
    disk route unloads versions the manager may still have requests on)."""
    body = {"input_ids": [5, 6, 7], "lora_path": "job@v4",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = pool.submit(http.post, "/generate", json=body)
        wait_until(lambda: sum(http.get("/server_info").json()["internal_states"][0][key]
                               for key in ("num_running_reqs", "num_waiting_reqs")) == 1)
        unload = pool.submit(http.post, "/unload_lora_adapter", json={"lora_name": "job@v4"})

        def refused() -> bool:
            try:
                return http.post("/generate", json=body, timeout=5.0).status_code == 400
            except httpx.TimeoutException:  # taken before the unload began: it waits, paused, as the first one does
                return False

        wait_until(refused)  # refused once the unload began
        assert not unload.done()  # it waits for the paused request
        assert http.post("/continue_generation").status_code == 200
        reply = pending.result(timeout=120)
        assert reply.status_code == 200 and reply.json()["meta_info"]["finish_reason"]["type"] == "length"
        assert len(reply.json()["output_ids"]) == 8
        unloaded = unload.result(timeout=120)
    assert unloaded.status_code == 200 and "job@v4" not in unloaded.json()["loaded_adapters"]


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
