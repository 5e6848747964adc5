"""Our SGLang request bodies against SGLang's own request classes, where sglang imports (it needs a GPU build of
torch, so this is skipped on CPU-only machines)."""

from __future__ import annotations

import pytest

from services.common.sglang import disk_update_body, distributed_update_body, update_group_body

io_struct = pytest.importorskip("sglang.srt.managers.io_struct", reason="sglang is not installed (GPU only)")


def test_weight_update_bodies_build_sglangs_request_classes():
    io_struct.InitWeightsUpdateGroupReqInput(**update_group_body("10.0.0.1", 29500, 1, 3, "physarum", "nccl"))
    io_struct.UpdateWeightsFromDistributedReqInput(**distributed_update_body(
        ["model.norm.weight"], ["bfloat16"], [[128]], "7", "physarum"))
    io_struct.UpdateWeightFromDiskReqInput(**disk_update_body("/snapshots/weight_v7", "7"))


def test_generate_body_builds_sglangs_generate_request():
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "rid": "job-0-0-1-0",
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16, "stop": [],
                                "stop_token_ids": [], "no_stop_trim": True, "skip_special_tokens": True}}
    request = io_struct.GenerateReqInput(**body)
    request.normalize_batch_and_arguments()
