"""Buffer put + take of sample groups through gRPC against a raw Redis pipeline writing and reading the same bytes.

`python bench/buffer_vs_redis.py [--rounds 10]`. A private redis-server and the buffer service run as processes.
Each round writes one rollout's groups through the buffer and reads them back, then the raw side does the same with
one Redis pipeline on the same Redis, two ways:
- bytes to bytes (`buffer_vs_redis`): the groups are encoded once where they are made (`encode_group`, outside the
  timing on both sides); the buffer side is `put_groups` of the encoded groups and `get_batch_encoded`, the bytes as
  the buffer serves them; the raw side SETs the same bytes and MGETs them back. The ratio is what the service adds:
  two gRPC hops, the server, the Lua bookkeeping of leases and groups.
- objects to objects (`*_same_objects`): SampleGroups in, SampleGroups out; the buffer side's client encodes and
  decodes (`put_groups`, `get_batch`), the raw side serializes (`group_to_proto`) and parses the same way.
Sizes: the demo's rollout (16 groups x 8 samples, ~10 tokens) and a long-response one (16 x 8, 1,024 tokens with
log-probs). Prints a table, then one JSON line (`buffer_vs_redis`: the demo's rollout, bytes to bytes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, median, print_table, start_grpc_service  # noqa: E402
from services.buffer.client import BufferClient  # noqa: E402
from services.common import procs  # noqa: E402
from services.common.gen.physarum.v1 import sample_pb2  # noqa: E402
from services.common.samples import (  # noqa: E402
    Sample,
    SampleGroup,
    Status,
    encode_group,
    group_from_proto,
    group_id_for,
    group_to_proto,
)

JOB = "bench-buffer"


def make_groups(rollout_id: int, num_groups: int, n_samples: int, num_tokens: int) -> list[SampleGroup]:
    return [SampleGroup(group_id=group_id_for(JOB, rollout_id, i), job_id=JOB, rollout_id=rollout_id, prompt_index=i,
                        epoch=rollout_id, samples=[
                            Sample(prompt="12+34=", tokens=list(range(num_tokens + 6)), response_length=num_tokens,
                                   response="46", label="46", reward=1.0, loss_mask=[1] * num_tokens,
                                   rollout_log_probs=[-0.25] * num_tokens, status=Status.COMPLETED,
                                   weight_versions=[str(rollout_id)], group_index=i, index=j)
                            for j in range(n_samples)])
            for i in range(num_groups)]


def main(argv: list[str] | None = None) -> int:
    import redis

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10, help="rollouts written and read per size and side")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-buffer-"))
    data = work / "prompts.jsonl"
    data.write_text("".join(f'{{"input": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(64)))
    redis_proc, redis_url = procs.start_redis(work / "redis", appendfsync="everysec")
    buffer_proc, addr = start_grpc_service(work, "services.buffer", "--redis-url", redis_url)
    rows, figures = [], {}
    try:
        raw = redis.Redis.from_url(redis_url)
        with BufferClient(addr, timeout_s=60.0) as client:
            client.load_dataset(JOB, str(data))
            rollout_id = 0
            for label, num_tokens in (("demo (10 tokens)", 4), ("long (1,024 tokens)", 1024)):
                times: dict[str, list[float]] = {"bytes": [], "objects": [], "raw_bytes": [], "raw_objects": []}
                for _ in range(args.rounds + 1):  # the first round warms up and is left out
                    for encoded in (True, False):
                        groups = make_groups(rollout_id, 16, 8, num_tokens)
                        made = [encode_group(g) for g in groups] if encoded else groups
                        start = time.perf_counter()
                        client.put_groups(made)
                        if encoded:
                            got = client.get_batch_encoded(JOB, rollout_id, len(groups), timeout_s=10.0)
                        else:
                            got = client.get_batch(JOB, rollout_id, len(groups), timeout_s=10.0)
                        times["bytes" if encoded else "objects"].append(time.perf_counter() - start)
                        assert len(got) == len(groups)
                        rollout_id += 1
                    keys = [f"raw:{rollout_id}:{i}" for i in range(len(groups))]
                    start = time.perf_counter()
                    payloads = [group_to_proto(g).SerializeToString() for g in groups]
                    pipeline_start = time.perf_counter()
                    pipe = raw.pipeline(transaction=False)
                    for key, payload in zip(keys, payloads, strict=True):
                        pipe.set(key, payload)
                    pipe.execute()
                    read = raw.mget(keys)
                    times["raw_bytes"].append(time.perf_counter() - pipeline_start)
                    back = [group_from_proto(sample_pb2.SampleGroup.FromString(payload)) for payload in read]
                    times["raw_objects"].append(time.perf_counter() - start)
                    assert back == got, "the raw side must read back what the buffer served"
                    num_bytes = sum(map(len, payloads))
                m = {key: median(values[1:]) for key, values in times.items()}
                figures[label] = (m["raw_bytes"] / m["bytes"], m["raw_objects"] / m["objects"])
                rows.append([label, f"{num_bytes / 1e6:.2f}", 1e3 * m["raw_bytes"], 1e3 * m["bytes"],
                             m["raw_bytes"] / m["bytes"], 1e3 * m["raw_objects"], 1e3 * m["objects"],
                             m["raw_objects"] / m["objects"]])
        raw.close()
    finally:
        buffer_proc.stop()
        redis_proc.stop()
    print_table(f"buffer: put + take of one rollout (16 groups x 8 samples), median of {args.rounds} rounds",
                ["rollout", "MB", "raw bytes ms", "buffer bytes ms", "raw / buffer, bytes (goal >= 0.3)",
                 "raw objects ms", "buffer objects ms", "raw / buffer, objects"], rows)
    (demo_bytes, demo), (long_bytes, long) = figures["demo (10 tokens)"], figures["long (1,024 tokens)"]
    emit({"buffer_vs_redis": demo_bytes, "buffer_vs_redis_1k_tokens": long_bytes,
          "buffer_vs_redis_same_objects": demo, "buffer_vs_redis_1k_tokens_same_objects": long})
    return 0


if __name__ == "__main__":
    sys.exit(main())
