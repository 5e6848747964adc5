"""`make images-test`: the images, built and run. After `make images` (buildah here), it checks each image as the chart
runs it, then trains the demo's jobs across the images, a container per service, and a plugin job whose code comes
from a plugin image. Ends with one JSON line; exit 1 when a check fails.

1. Each image: its entry point answers `--help` as uid 10001 from /app, its Python is the constraints' (3.11), /tmp
   (HOME) is writable, and the rollout, reward and trainer images import `slime` (compat/slime).
2. The plugin image (deploy/plugins/Dockerfile with PLUGIN_DIR=examples): its /plugins is copied as the chart's init
   container copies it (`cp -R /plugins/. <volume>` as uid 10001) into a folder that every container then mounts
   at plugins.mountPath, on PYTHONPATH.
3. The stack (tests/images/stack.py) and three jobs through the job API: the demo's SFT warm-up and GRPO job
   (fewer rollouts than `make demo`), held-out reward before and after, and the multi-turn calculator (a plugin
   job: custom generate and reward functions from the plugin image).

Run: python -m tests.images.run --registry R --version V [--skip-jobs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tests.images.buildah import Container, buildah, image_config

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ("buffer", "reward", "rollout", "engine", "trainer", "router")
# what slime's plugins import where they run: generate and reward functions (rm_hub too) in the rollout manager and
# the reward service, loss and MIS functions (Sample, cp_utils) in the trainer
SLIME_IMPORTS = {"rollout": "slime.utils.types, slime.rollout.rm_hub",
                 "reward": "slime.utils.types, slime.rollout.rm_hub",
                 "trainer": "slime.utils.types, slime.backends.megatron_utils.cp_utils"}
WORK = ROOT / ".physarum" / "images-test"
JOB_TIMEOUT_S = 3600.0  # a stuck job ends the run instead of hanging it


def check_image(registry: str, version: str, name: str) -> list[str]:
    """What is wrong with one image, run as the chart runs it (nothing: [])."""
    image = f"{registry}/physarum-{name}:{version}"
    config = image_config(image)
    problems = []
    if config.get("User") != "10001:10001":
        problems.append(f"{name}: USER is {config.get('User')!r}, not 10001:10001")
    container = Container(image, f"physarum-images-test-check-{name}").create()
    try:
        entry = [*config.get("Entrypoint", []), "--help"]
        result = container.run(entry, {"HOME": "/tmp"}, timeout_s=300)
        if result.returncode:
            problems.append(f"{name}: `{' '.join(entry)}` exited {result.returncode}: {result.stderr[-300:]}")
        probe = ("import sys, pathlib; pathlib.Path('/tmp/w').write_text('x'); "
                 "print('%d.%d' % sys.version_info[:2])")
        if name in SLIME_IMPORTS:
            probe += f"; import {SLIME_IMPORTS[name]}"
        result = container.run(["python", "-c", probe], {"HOME": "/tmp"})
        if result.returncode or result.stdout.strip() != "3.11":
            problems.append(f"{name}: python probe gave {result.returncode} {result.stdout!r} {result.stderr[-300:]}")
    finally:
        container.remove()
    return problems


def copy_plugins(plugin_image: str, volume: Path) -> list[str]:
    """The chart's init container: `cp -R <sourcePath>/. <volume>` as uid 10001 into an empty folder."""
    shutil.rmtree(volume, ignore_errors=True)
    volume.mkdir(parents=True)
    os.chown(volume, 10001, 10001)  # an emptyDir under the pod's fsGroup
    container = Container(plugin_image, "physarum-images-test-plugins", [(str(volume), "/plugins-volume", False)])
    container.create()
    try:
        result = container.run(["cp", "-R", "/plugins/.", "/plugins-volume/"])
    finally:
        container.remove()
    if result.returncode:
        return [f"plugins: the copy failed: {result.stderr[-300:]}"]
    if not (volume / "examples" / "multiturn" / "calculator.py").exists():
        return [f"plugins: {volume} lacks examples/multiturn/calculator.py after the copy"]
    return []


def run_jobs(stack, model_dir: Path) -> dict:
    """The jobs, named by the paths the pods see (the models volume at MODELS, the checkpoints one at CHECKPOINTS);
    the held-out reward is measured from here through the router, with the tokenizer of model_dir."""
    from physarum.cli import follow, load_job_file
    from physarum.demo import evaluate
    from services.trainer.api.client import JobsRestClient
    from tests.images.stack import CHECKPOINTS, MODELS

    state = {"router_url": f"http://{stack.addr['router']}", "reward_addr": stack.addr["reward"]}
    held_out = stack.models_dir / "data" / "task" / "test.jsonl"
    task, multiturn = f"{MODELS}/data/task", f"{MODELS}/data/multiturn"
    result: dict = {"held_out_before": evaluate(state, model_dir, held_out)}
    jobs = [
        ("sft", ROOT / "examples/demo/sft.yaml", [f"hf_checkpoint={MODELS}/model", f"prompt_data={task}/sft.jsonl",
                                                  "num_rollout=40", f"save_hf={CHECKPOINTS}/sft-model"]),
        ("grpo", ROOT / "examples/demo/job.yaml", [f"hf_checkpoint={CHECKPOINTS}/sft-model",
                                                   f"prompt_data={task}/train.jsonl", "num_rollout=100"]),
        ("multiturn", ROOT / "examples/multiturn/job.yaml", [
            f"hf_checkpoint={MODELS}/model", f"prompt_data={multiturn}/train.jsonl", "num_rollout=2",
            f"eval_prompt_data=[calc={multiturn}/test.jsonl]", "eval_interval=2"]),
    ]
    with JobsRestClient(stack.trainer_url, token=stack.api_token) as client:
        for name, path, overrides in jobs:
            start = time.monotonic()
            job = client.submit(load_job_file(path, overrides))
            job = follow(client, job["job_id"], job["num_rollout"], timeout_s=JOB_TIMEOUT_S)
            events = client.events(job["job_id"])
            rewards = [e["metrics"]["rollout/reward_mean"] for e in events if "rollout/reward_mean" in e["metrics"]]
            result[name] = {"state": job["state"], "error": job.get("error", ""), "rollouts": len(events),
                            "seconds": round(time.monotonic() - start), "reward_first": rewards[:3],
                            "reward_last": rewards[-3:]}
            if name == "sft":
                result["held_out_after_sft"] = evaluate(state, model_dir, held_out)
            if name == "grpo":
                result["held_out_after_grpo"] = evaluate(state, model_dir, held_out)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", default="localhost")
    parser.add_argument("--version", required=True)
    parser.add_argument("--plugin-image", default="", help="the plugin image (default: REGISTRY/physarum-plugins-"
                                                           "examples:VERSION)")
    parser.add_argument("--skip-jobs", action="store_true", help="check the images only")
    args = parser.parse_args(argv)
    plugin_image = args.plugin_image or f"{args.registry}/physarum-plugins-examples:{args.version}"
    start = time.monotonic()
    problems = [p for name in IMAGES for p in check_image(args.registry, args.version, name)]
    print(f"images-test: {len(IMAGES)} images checked, {len(problems)} problems", flush=True)
    summary: dict = {"images": len(IMAGES), "problems": problems}
    plugin_dir = WORK / "plugins"
    problems += copy_plugins(plugin_image, plugin_dir)
    if not args.skip_jobs and not problems:
        from examples.multiturn.build_dataset import main as build_multiturn
        from physarum import tasks, tinymodel
        from tests.images.stack import ImageStack

        models = WORK / "models"  # the models volume: the tiny model and the jobs' prompt data
        model_dir = tinymodel.build_tiny_model(models / "model", tasks.corpus(), seed=0)
        tasks.write_addition_task(models / "data" / "task")
        build_multiturn([str(models / "data" / "multiturn")])
        for path in [models, *models.rglob("*")]:  # the volume is the pods' own (the chart's fsGroup; model files
            os.chown(path, 10001, 10001)           # are written 0600 here)
        stack = ImageStack(args.registry, args.version, WORK / "stack", models, plugin_dir=plugin_dir)
        try:
            stack.up()
            summary.update(run_jobs(stack, model_dir))
        finally:
            stack.down()
        for name in ("sft", "grpo", "multiturn"):
            if summary[name]["state"] != "SUCCEEDED":
                problems.append(f"job {name}: {summary[name]['state']} {summary[name]['error']}")
        if not summary["held_out_after_grpo"] > summary["held_out_before"]:
            problems.append(f"no reward rise: held-out {summary['held_out_before']:.3f} -> "
                            f"{summary['held_out_after_grpo']:.3f}")
    summary.update(problems=problems, seconds=round(time.monotonic() - start))
    for problem in problems:
        print(f"images-test: {problem}", file=sys.stderr)
    print(json.dumps(summary))
    return 1 if problems else 0


if __name__ == "__main__":
    buildah("version")  # fails fast, naming buildah, when it is missing
    sys.exit(main())
