"""`physarum`: the user's handle on the local stack and on jobs (up, down, submit, status, cancel)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from physarum import stack
from services.common import strict_json

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def load_job_file(path: Path | None, overrides: list[str], slime_args: str = "") -> dict[str, Any]:
    """The job YAML (none: an empty spec) with `--set key=value` overrides (values parsed as YAML scalars or
    lists) and slime's argv (`--slime-args`, converted by the job API; the YAML's and --set's keys win). Anything that
    is not plain JSON once loaded (binary bytes, `.nan`, a date, deep nesting) ends the command with one line."""
    spec: Any = {}
    if path is not None:
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except OSError as err:
            raise SystemExit(f"physarum: cannot read job file {path}: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise SystemExit(f"physarum: job file {path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
        spec = _yaml(text, f"job file {path}") or {}
    if not isinstance(spec, dict):
        raise SystemExit(f"physarum: job file {path}: expected a mapping of slime flag names to values")
    if slime_args:
        spec["slime_args"] = slime_args
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"physarum: --set expects key=value, got {item!r}")
        spec[key.strip()] = _yaml(value, f"--set {key.strip()}")
    if not spec:
        raise SystemExit("physarum: submit needs a job file, --slime-args, or both")
    if problem := strict_json.check_value(spec, ""):
        raise SystemExit(f"physarum: job spec: {problem}")
    return spec


def _yaml(text: str, what: str) -> Any:
    """YAML text as data, or SystemExit with one line naming `what` and where the YAML is wrong."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SystemExit(f"physarum: {what}: invalid YAML{where}: {err.problem or err.context}") from None
    except yaml.YAMLError as err:  # e.g. the reader's "unacceptable character #x0000"
        raise SystemExit(f"physarum: {what}: invalid YAML: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise SystemExit(f"physarum: {what}: nested more than {strict_json.MAX_DEPTH} levels") from None


def _job_api(args) -> str:
    if args.url:
        return args.url
    state = stack.read_state(args.work_dir)
    if state is None:
        raise SystemExit("physarum: no local stack is up (run `physarum up`) and no --url was given")
    return state["trainer_url"]


def follow(client, job_id: str, num_rollout: int, poll_s: float = 0.5, timeout_s: float = 24 * 3600) -> dict:
    """Show a progress bar (step, mean reward, time) until the job ends; returns the final job."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}")]
    after, deadline = 0, time.monotonic() + timeout_s
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(job_id, total=num_rollout, info="")
        while time.monotonic() < deadline:
            for event in client.events(job_id, after_seq=after):
                after = event["seq"]
                metrics = event["metrics"]
                shown = [f"{label} {metrics[key]:.3f}" for label, key in
                         (("reward", "rollout/reward_mean"), ("loss", "train/loss")) if key in metrics]
                info = "  ".join(shown) or event["message"]
                progress.update(task, completed=event["rollout_id"] + 1, info=info)
            job = client.get(job_id)
            if job["state"] in TERMINAL:
                return job
            time.sleep(poll_s)
    raise SystemExit(f"physarum: job {job_id} still running after {timeout_s} s")


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    """--device (the trainer's) and --engine-device (the CPU engines'), shared by `up` and the demo."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="the trainer's ranks: auto (rank r on cuda:r when CUDA is present), cuda, or cpu")
    parser.add_argument("--engine-device", choices=("cpu", "cuda"), default="cpu",
                        help="the CPU engines' device (cuda: the whole loop on one GPU)")


def cmd_up(args) -> int:
    if args.trainer_ranks < 1:
        raise SystemExit(f"physarum: --trainer-ranks must be >= 1, got {args.trainer_ranks}")
    if args.model is None:
        from physarum.demo_model import demo_model

        args.model, _ = demo_model()
        print(f"no --model: starting on the demo's model, {args.model} (`physarum submit examples/demo/sft.yaml`)")
    state = stack.up(stack.StackOptions(work_dir=args.work_dir, model_path=args.model, num_engines=args.engines,
                                        trainer_ranks=args.trainer_ranks, redis_appendfsync=args.redis_appendfsync,
                                        plugin_allowlist=args.plugin_allowlist, auth=args.auth,
                                        trainer_device=args.device, engine_device=args.engine_device,
                                        path_roots=tuple(args.root) if args.root else None, supervise=True))
    print(f"stack up: job API {state['trainer_url']} (docs at /docs), router {state['router_url']}")
    print(dashboard_note(state, args.work_dir))
    return 0


def dashboard_note(state: dict, work_dir: Path) -> str:
    """Where the dashboard is and the token to paste into its sign-in field (none when authentication is off)."""
    from services.common import auth

    token = auth.read_token("trainer", stack.operator_token_dir(work_dir))
    return f"dashboard: {state['trainer_url']}/dashboard/  " + (
        f"token: {token}" if token else "(no token: authentication is off; choose \"No token\" there)")


def cmd_down(args) -> int:
    stopped = stack.down(args.work_dir)
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def cmd_submit(args) -> int:
    from services.trainer.api.client import JobsRestClient

    spec = load_job_file(args.job_file, args.set or [], args.slime_args)
    with JobsRestClient(_job_api(args), token=args.token) as client:
        job = client.submit(spec)
        print(f"submitted {job['job_id']}")
        print(f"  job token (opens this job's status, events, cancel and samples, no other job's): "
              f"{job['job_token']}")
        for note in job["spec"].get("slime_notes", []):
            print(f"  note: {note}")
        if not args.wait:
            return 0
        job = follow(client, job["job_id"], job["num_rollout"])
    print(f"{job['job_id']}: {job['state']}" + (f": {job['error']}" if job["error"] else ""))
    return 0 if job["state"] == "SUCCEEDED" else 1


def cmd_status(args) -> int:
    from services.trainer.api.client import JobsRestClient

    if not args.job_id and not args.url and (state := stack.read_state(args.work_dir)) is not None:
        print(services_table(state, args.work_dir))
    with JobsRestClient(_job_api(args), token=args.token) as client:
        jobs = [client.get(args.job_id)] if args.job_id else client.list()
    for job in jobs:
        reward = job["metrics"].get("rollout/reward_mean")
        shown = f" reward {reward:.3f}" if reward is not None else ""
        print(f"{job['job_id']}  {job['state']:<9}  rollout {job['rollout_id'] + 1}/{job['num_rollout']}{shown}"
              + (f"  error: {job['error']}" if job["error"] else ""))
    return 0


def services_table(state: dict, work_dir: Path) -> str:
    """The local stack's processes: each running or not, and how often the supervisor started it again."""
    from physarum import supervisor

    record = supervisor.read(work_dir)
    lines = [f"{'service':<14} {'state':<8} {'pid':>8} {'restarts':>8}"]
    entries = [*state["processes"], *([state["supervisor"]] if state.get("supervisor") else [])]
    for entry in entries:
        name = "trainer" if stack.is_trainer(entry) else entry["name"]
        running = "running" if stack.owned(entry) else "down"
        error = record["errors"].get(name, "") if not stack.owned(entry) else ""
        lines.append(f"{entry['name']:<14} {running:<8} {entry['pid']:>8} {record['restarts'].get(name, 0):>8}"
                     + (f"  last error: {error}" if error else ""))
    return "\n".join(lines)


def cmd_restart(args) -> int:
    try:
        entry = stack.restart(args.work_dir, args.service)
    except ValueError as err:  # no stack, or no such service in it
        raise SystemExit(f"physarum: {err}") from None
    print(f"{args.service}: started again (pid {entry['pid']})")
    return 0


def cmd_logs(args) -> int:
    """A service's log (stack.json's record of it), or a job's lines from the trainer's and the manager's logs."""
    state = stack.read_state(args.work_dir)
    if state is None:
        raise SystemExit(f"physarum: no local stack in {args.work_dir} (run `physarum up`)")
    entries = [*state["processes"], *([state["supervisor"]] if state.get("supervisor") else [])]
    by_name = {e["name"]: Path(e["log"]) for e in entries}
    if args.target in by_name:
        paths, match = [by_name[args.target]], None
    else:  # a job id: its lines in the logs of the trainer's ranks and of the rollout manager
        paths = [path for name, path in by_name.items() if stack.is_trainer({"name": name}) or name == "rollout"]
        match = args.target
    sizes = {path: 0 for path in paths}
    while True:
        for path in paths:
            try:
                with open(path, "rb") as log_file:
                    log_file.seek(sizes[path])
                    data = log_file.read()
            except OSError:
                continue
            sizes[path] += len(data)
            for line in data.decode(errors="replace").splitlines():
                if match is None or match in line:
                    print(line if len(paths) == 1 else f"{path.stem}: {line}", flush=True)
        if not args.follow:
            return 0
        time.sleep(0.5)


def cmd_cancel(args) -> int:
    from services.trainer.api.client import JobsRestClient

    with JobsRestClient(_job_api(args), token=args.token) as client:
        job = client.cancel(args.job_id)
    print(f"{job['job_id']}: {job['state']}")
    return 0


# --- physarum scale: the rollout engine pool -------------------------------------------------------------------
def cmd_scale(args) -> int:
    from services.rollout.client import RolloutClient

    addr = args.addr or (stack.read_state(args.work_dir) or {}).get("rollout_addr")
    if not addr:
        raise SystemExit("physarum: no local stack is up (run `physarum up`) and no --addr was given")
    with RolloutClient(addr) as client:
        status = client.scale(args.replicas)
    print(f"engine pool: {status.desired_replicas} engines wanted, weight version {status.weight_version or '-'}")
    for e in status.engines:
        print(f"  {e.name:<12} {e.state.name:<9} {e.url}  version {e.weight_version or '-'}  load {e.load}")
    return 0
# --- end physarum scale ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="physarum", description=__doc__)
    parser.add_argument("--work-dir", type=Path, default=stack.DEFAULT_WORK_DIR, help="local stack directory")
    parser.add_argument("--token", default=os.environ.get("PHYSARUM_API_TOKEN", ""),
                        help="job API bearer token (default: $PHYSARUM_API_TOKEN)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start the local stack")
    p.add_argument("--model", type=Path, default=None,
                   help="HF model directory the engines start from (default: the demo's tiny model, built if missing)")
    p.add_argument("--engines", type=int, default=2, help="number of CPU engines")
    p.add_argument("--redis-appendfsync", choices=("always", "everysec", "no"), default="always",
                   help="fsync policy of the local Redis's append-only file (always: no acknowledged write lost to a "
                        "crash; everysec: the last second or two can be, and a group can train twice)")
    p.add_argument("--plugin-allowlist", default=os.environ.get("PHYSARUM_PLUGIN_ALLOWLIST", "examples"),
                   help="comma-separated module prefixes that jobs may name as plugins (reward, generate, loss, "
                        "filters)")
    p.add_argument("--no-auth", dest="auth", action="store_false",
                   help="no per-service tokens (by default every port but health and metrics needs one)")
    p.add_argument("--root", action="append", type=Path, metavar="DIR",
                   help="a directory jobs may read data and models under and write checkpoints and exports under "
                        "(repeatable; default: the work dir's private files/ directory, the current directory and "
                        "the work dir's parent, none of them world-writable); any other path in a job spec is "
                        "refused at submit and when it is written")
    p.add_argument("--trainer-ranks", type=int, default=1,
                   help="trainer processes: rank 0 serves the job API, the others train data-parallel (FSDP2)")
    add_device_flags(p)
    p.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the local stack").set_defaults(fn=cmd_down)
    p = sub.add_parser("restart", help="start one service of the local stack again (the trainer: all its ranks)")
    p.add_argument("service", help="redis, sglang-router, buffer, reward, rollout or trainer")
    p.set_defaults(fn=cmd_restart)
    p = sub.add_parser("logs", help="a service's log, or a job's lines in the trainer's and the manager's logs")
    p.add_argument("target", metavar="SERVICE|JOB")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is written")
    p.set_defaults(fn=cmd_logs)
    p = sub.add_parser("submit", help="submit a job spec (YAML keyed by slime's flag names)")
    p.add_argument("job_file", type=Path, nargs="?", default=None)
    p.add_argument("--slime-args", default="", metavar="ARGV",
                   help="slime's train.py arguments as one string, pasted from a launch script (docs/slime-flags.md)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec key (repeatable)")
    p.add_argument("--wait", action="store_true", help="follow the job and exit 0 only if it succeeds")
    p.add_argument("--url", default="", help="job API URL (default: the local stack's)")
    p.set_defaults(fn=cmd_submit)
    p = sub.add_parser("status", help="show jobs")
    p.add_argument("job_id", nargs="?", default="")
    p.add_argument("--url", default="")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id")
    p.add_argument("--url", default="")
    p.set_defaults(fn=cmd_cancel)
    # --- physarum scale ---
    p = sub.add_parser("scale", help="set the number of rollout engines, also while a job runs")
    p.add_argument("--replicas", type=int, required=True, help="desired number of engines")
    p.add_argument("--addr", default="", help="rollout manager host:port (default: the local stack's)")
    p.set_defaults(fn=cmd_scale)
    # --- end physarum scale ---
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from services.common import auth
    from services.common.errors import PhysarumError

    operator_dir = stack.operator_token_dir(args.work_dir)
    if args.command != "up" and not os.environ.get(auth.TOKEN_DIR_ENV) and operator_dir.is_dir():
        os.environ[auth.TOKEN_DIR_ENV] = str(operator_dir)  # the tokens the local stack issued its operator
    args.token = args.token or auth.read_token("trainer")

    try:
        return args.fn(args)
    except (PhysarumError, stack.StackConflict) as err:
        print(f"physarum: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
