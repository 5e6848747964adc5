"""The cost of Redis `appendfsync always` against `everysec` (the chart's and `physarum up`'s default) on the buffer's
per-rollout path, side by side: two private redis-servers with their AOF on the same disk, a buffer service on each.

`python bench/redis_appendfsync.py [--rounds 20]`. Each round leases one rollout's prompts, writes its groups with
`put_groups` and takes them with `take_batch`: every write the loop makes to Redis for a rollout, each acknowledged
only once Redis has it (with `always`, once it is fsynced). The two sides alternate round by round, so the machine's
other load moves both. Sizes: the demo's rollout (16 groups x 8 samples, ~10 tokens) and a long-response one (16 x 8,
1,024 tokens with log-probs). Prints a table, then one JSON line (`appendfsync_always_over_everysec`: the demo's
rollout time with `always` over `everysec`; 1.0 means free).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, median, print_table, start_grpc_service  # noqa: E402
from bench.buffer_vs_redis import make_groups  # noqa: E402
from services.buffer.client import BufferClient  # noqa: E402
from services.common import procs  # noqa: E402
from services.common.samples import SampleGroup, group_id_for  # noqa: E402

JOB = "bench-buffer"  # make_groups' job
POLICIES = ("everysec", "always")


def one_rollout(client: BufferClient, rollout_id: int, num_tokens: int) -> float:
    """Seconds for lease, put and take of rollout `rollout_id` (16 groups of 8 samples)."""
    groups = make_groups(rollout_id, 16, 8, num_tokens)
    start = time.perf_counter()
    prompts = client.lease_prompts(JOB, rollout_id, len(groups), 60.0)
    leased = [SampleGroup(group_id=group_id_for(JOB, p.epoch, p.index), job_id=JOB, rollout_id=rollout_id,
                          prompt_index=p.index, epoch=p.epoch, samples=g.samples, lease_id=p.lease_id)
              for p, g in zip(prompts, groups, strict=True)]
    client.put_groups(leased)
    taken = client.take_batch(JOB, rollout_id, len(leased), min_weight_version=0, timeout_s=10.0)
    elapsed = time.perf_counter() - start
    assert len(taken.groups) == len(leased), (len(taken.groups), len(leased))
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20, help="rollouts per size and policy")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-fsync-"))
    data = work / "prompts.jsonl"
    data.write_text("".join(f'{{"input": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(4096)))
    started, clients = [], {}
    try:
        for policy in POLICIES:
            redis_proc, redis_url = procs.start_redis(work / f"redis-{policy}", appendfsync=policy)
            buffer_proc, addr = start_grpc_service(work / policy, "services.buffer", "--redis-url", redis_url)
            started += [buffer_proc, redis_proc]
            clients[policy] = BufferClient(addr, timeout_s=60.0)
            clients[policy].load_dataset(JOB, str(data))
        rows, ratios, rollout_id = [], {}, 0
        for label, num_tokens in (("demo (10 tokens)", 4), ("long (1,024 tokens)", 1024)):
            seconds: dict[str, list[float]] = {p: [] for p in POLICIES}
            for _ in range(args.rounds + 1):  # the first round warms up and is left out
                for policy in POLICIES:
                    seconds[policy].append(one_rollout(clients[policy], rollout_id, num_tokens))
                rollout_id += 1
            everysec, always = median(seconds["everysec"][1:]), median(seconds["always"][1:])
            ratios[label] = always / everysec
            rows.append([label, 1e3 * everysec, 1e3 * always, always / everysec])
    finally:
        for client in clients.values():
            client.close()
        for proc in started:
            proc.stop()
    print_table(f"buffer: lease + put + take of one rollout (16 groups x 8 samples), median of {args.rounds} rounds",
                ["rollout", "everysec ms", "always ms", "always / everysec"], rows)
    emit({"appendfsync_always_over_everysec": ratios["demo (10 tokens)"],
          "appendfsync_always_over_everysec_1k_tokens": ratios["long (1,024 tokens)"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
