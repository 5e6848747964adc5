"""Choose the demo's settings fast: the demo's two jobs (examples/demo/sft.yaml, then job.yaml) in one process
(bench/inprocess_loop.py), printing held-out reward before training, after SFT and after GRPO for each seed.

`python bench/demo_sweep.py --seeds 0,1,2 [--sft KEY=VALUE ...] [--grpo KEY=VALUE ...]`. Same model, task split,
losses and optimizer as `make demo`; generation is `transformers` sampling, not the engines', so numbers differ
from the demo's by sampling noise. Ends with one JSON line of the numbers per seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.inprocess_loop import InProcessLoop  # noqa: E402
from physarum import tasks, tinymodel  # noqa: E402
from physarum.cli import load_job_file  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples/demo"


def run_seed(seed: int, work: Path, sft_sets: list[str], grpo_sets: list[str], threads: int,
             sft_on_all: bool = False) -> dict:
    model = tinymodel.build_tiny_model(work / f"model-{seed}", tasks.corpus(), seed=seed)
    train, test = tasks.write_addition_task(work / "task")
    test_rows = [json.loads(line) for line in test.read_text().splitlines()]
    common = {"seed": seed, "rollout_seed": seed}
    sft_spec = {**load_job_file(EXAMPLES / "sft.yaml", sft_sets), **common,
                "prompt_data": str(train if sft_on_all else train.parent / "sft.jsonl"), "hf_checkpoint": str(model)}
    sft_spec.pop("save_hf", None)
    start = time.monotonic()
    sft = InProcessLoop(sft_spec, num_threads=threads)
    before = sft.evaluate(test_rows)
    for _ in range(sft.spec.num_rollout):
        sft.step()
    after_sft = sft.evaluate(test_rows)
    sft_s = time.monotonic() - start
    sft.backend.save_hf(work / f"sft-{seed}")
    grpo_spec = {**load_job_file(EXAMPLES / "job.yaml", grpo_sets), **common, "prompt_data": str(train),
                 "hf_checkpoint": str(work / f"sft-{seed}")}
    grpo = InProcessLoop(grpo_spec, num_threads=threads)
    curve = []
    for i in range(grpo.spec.num_rollout):
        rewards = [s.reward for s in grpo.step()]
        if (i + 1) % max(1, grpo.spec.num_rollout // 5) == 0:
            curve.append(round(grpo.evaluate(test_rows), 3))
            print(f"  seed {seed} GRPO rollout {i + 1}: train reward {sum(rewards) / len(rewards):.3f}, held-out "
                  f"{curve[-1]:.3f}", flush=True)
    after = grpo.evaluate(test_rows)
    result = {"seed": seed, "before": before, "sft": after_sft, "grpo": after, "grpo_gain": after - after_sft,
              "sft_s": sft_s, "grpo_s": time.monotonic() - start - sft_s, "curve": curve}
    print(f"seed {seed}: reward {before:.3f} -> {after_sft:.3f} (SFT) -> {after:.3f} (GRPO), GRPO gain "
          f"{after - after_sft:+.3f} (SFT {result['sft_s']:.0f} s, GRPO {result['grpo_s']:.0f} s)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sft", action="append", default=[], help="override an SFT job key (KEY=VALUE)")
    parser.add_argument("--grpo", action="append", default=[], help="override a GRPO job key (KEY=VALUE)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sft-on-all", action="store_true", help="warm up on every train pair, not only a <= b")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-demo-sweep-"))
    results = [run_seed(int(seed), work, args.sft, args.grpo, args.threads, args.sft_on_all)
               for seed in args.seeds.split(",")]
    print(json.dumps({"sft": args.sft, "grpo": args.grpo, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
