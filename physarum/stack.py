"""The local stack (`physarum up` / `down`): every service as a process on loopback, started once.

Starts a private redis-server, buffer, reward, the real sglang-router, the rollout manager (which starts the
CPU engines) and the trainer's ranks (rank 0 serves the job API; ranks 1.. run services.trainer.ranks.worker, with
torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); records each PID, command line and environment in
stack.json so `down` stops exactly those and `restart` starts one again. `up` on a work dir whose stack is partly
alive adopts it (the same tokens, ports and Redis) and starts only what is missing; with `supervise` it also starts
the supervisor (physarum/supervisor.py), which restarts whatever dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common.procs import (
    HOST,
    ManagedProcess,
    cmdline_of,
    free_port,
    python_module,
    redis_answers,
    start_redis,
    start_time,
    terminate,
)
from services.rollout.local import start_router, stop_leftover_engines

log = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path(".physarum/stack")
STATE_FILE = "stack.json"


@dataclass
class StackOptions:
    work_dir: Path = DEFAULT_WORK_DIR
    model_path: Path | None = None      # the engines' initial weights (a HF directory)
    num_engines: int = 2
    engine_threads: int = 1
    trainer_threads: int = 2
    trainer_ranks: int = 1              # data-parallel trainer processes (FSDP2 over gloo)
    engine_per_token_delay_s: float = 0.0  # latency-controlled engines (benchmarks): extra seconds per decode step
    trainer_device: str = "auto"        # auto (the GPU when there is one), cuda or cpu (GPUs hidden from the trainer)
    engine_device: str = "cpu"          # the CPU engines' device: cpu or cuda
    redis_appendfsync: str = "always"   # Redis AOF fsync policy: always (no acknowledged write lost), everysec, no
    plugin_allowlist: str | None = None  # module prefixes jobs may name as plugins (None: the caller's environment)
    auth: bool = False                   # per-service tokens on every port (`physarum up` turns it on)
    path_roots: tuple[Path, ...] | None = None  # where jobs may read and write (None: default_path_roots)
    start_timeout_s: float = 180.0
    supervise: bool = False              # a supervisor restarts what dies (`physarum up`; tests that kill choose)


def default_path_roots(work_dir: Path) -> tuple[Path, ...]:
    """Where a local stack's jobs may read and write by default: the stack's private `files` directory (created
    0700), the directory `up` ran from and the one that holds the work dir; never a world-writable directory (the
    system temporary directory, say), where another user could plant a link."""
    private = Path(work_dir).resolve() / "files"
    private.mkdir(mode=0o700, parents=True, exist_ok=True)
    roots = (private, Path.cwd(), Path(work_dir).resolve().parent)
    return tuple(dict.fromkeys(root.resolve() for root in roots if not _world_writable(root)))


def _world_writable(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & stat.S_IWOTH)
    except OSError:
        return True


def root_flags(options: StackOptions, work_dir: Path) -> tuple[list[str], list[str]]:
    """(the trainer's flags, the buffer's flags) confining job paths: datasets, models and checkpoints are read and
    checkpoints and exports written under the roots; the engines' model directory may also be read."""
    roots = [Path(r).resolve() for r in (options.path_roots or default_path_roots(work_dir))]
    readable = ",".join(str(r) for r in dict.fromkeys([*roots, *([options.model_path.resolve()]
                                                                if options.model_path else [])]))
    writable = ",".join(str(r) for r in roots)
    return (["--data-roots", readable, "--checkpoint-roots", writable, "--export-roots", writable],
            ["--data-roots", readable])


def _grpc_ready(addr: str):
    from services.common.grpc_client import wait_for_health

    def check() -> bool:
        try:
            wait_for_health(addr, timeout_s=0.5)
            return True
        except TimeoutError:
            return False
    return check


def _http_ready(url: str):
    import httpx

    def check() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    return check


def read_state(work_dir: Path = DEFAULT_WORK_DIR) -> dict | None:
    path = Path(work_dir) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


class StackConflict(RuntimeError):
    """`up` found a stack it can neither adopt nor replace safely."""


@contextlib.contextmanager
def locked(work_dir: Path) -> Iterator[None]:
    """The work dir's lock: one `up`, `restart`, `down` or supervisor round changes the stack at a time."""
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(work_dir) / "stack.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def up(options: StackOptions) -> dict:
    """Start the stack; a stack already in the work dir is adopted: if all of it runs it is returned as it is, if
    part of it runs the rest is started again with its recorded ports, tokens and Redis (StackConflict when that
    cannot be done); only a stack of which nothing runs is replaced. Returns its state (addresses and processes)."""
    work_dir = options.work_dir.resolve()
    with locked(work_dir):
        state = read_state(work_dir)
        if state is not None and any(owned(e) for e in state["processes"]):
            state = _adopt(work_dir, state, options)
        else:
            state = _fresh(work_dir, options)
    if options.supervise:
        start_supervisor(work_dir)
    return read_state(work_dir) or state


def _adopt(work_dir: Path, state: dict, options: StackOptions) -> dict:
    """Start again, as recorded, the processes of a partly running stack (the lock held)."""
    missing = [str(Path(env_dir)) for e in state["processes"] for env_dir in e.get("env", {}).values()
               if env_dir.startswith(str(work_dir / "secrets")) and not Path(env_dir).is_dir()]
    if missing:
        raise StackConflict(f"up: the stack in {work_dir} is partly running but its tokens ({missing[0]}) are gone; "
                            "run `physarum down` first, then `physarum up`")
    dead = []
    for entry in state["processes"]:
        name = "trainer" if is_trainer(entry) else entry["name"]
        if name not in dead and not owned(entry):
            dead.append(name)
    for name in dead:
        log.info("up: %s is not running; starting it again as recorded", name)
        try:
            restart(work_dir, name, start_timeout_s=options.start_timeout_s, lock_held=True)
        except Exception as err:
            raise StackConflict(f"up: the stack in {work_dir} is partly running and {name} could not be started "
                                f"again ({err}); run `physarum down` first, then `physarum up`") from err
    return read_state(work_dir)


def start_supervisor(work_dir: Path) -> None:
    """Start the work dir's supervisor unless it runs; recorded in stack.json as `supervisor`."""
    with locked(work_dir):
        state = read_state(work_dir)
        if state is None or (state.get("supervisor") and owned(state["supervisor"])):
            return
        proc = ManagedProcess("supervisor", python_module("physarum.supervisor", "--work-dir", str(work_dir)),
                              work_dir / "logs" / "supervisor.log").start()
        state["supervisor"] = _entry(proc)
        _write_state(work_dir, state)


def _write_state(work_dir: Path, state: dict) -> None:
    tmp = Path(work_dir) / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(Path(work_dir) / STATE_FILE)


def _fresh(work_dir: Path, options: StackOptions) -> dict:
    """A new stack (nothing of an earlier one runs): fresh Redis and tokens (the lock held)."""
    from services.common import weight_copies

    weight_copies.remove_stale()  # what trainers of an earlier stack left in shared memory
    if options.model_path is None:
        raise ValueError("up: a model directory is needed for the engines (--model)")
    logs = work_dir / "logs"
    # The local stack is ephemeral: a fresh Redis, so a job id reused across `up`s never meets old groups.
    shutil.rmtree(work_dir / "redis", ignore_errors=True)
    redis, redis_url = start_redis(work_dir / "redis", appendfsync=options.redis_appendfsync)
    token_dirs = write_credentials(work_dir / "secrets") if options.auth else {name: {} for name in GRANTS}
    ports = {name: free_port() for name in ("buffer", "reward", "reward_rest", "router", "router_metrics",
                                            "rollout", "trainer", "trainer_rest")}
    addr = {name: f"{HOST}:{port}" for name, port in ports.items()}
    router_url = f"http://{addr['router']}"
    processes = [redis]
    try:
        processes.append(start_router(ports["router"], ports["router_metrics"], logs / "router.log",
                                      env=token_dirs["router"]))
        specs = {
            "buffer": python_module("services.buffer", "--host", HOST, "--port", str(ports["buffer"]),
                                    "--redis-url", redis_url, *root_flags(options, work_dir)[1]),
            "reward": python_module("services.reward", "--host", HOST, "--port", str(ports["reward"]),
                                    "--rest-port", str(ports["reward_rest"])),
            "rollout": python_module("services.rollout", "--host", HOST, "--port", str(ports["rollout"]),
                                     "--buffer-addr", addr["buffer"], "--reward-addr", addr["reward"],
                                     "--router-url", router_url, "--model-path", str(options.model_path.resolve()),
                                     "--num-engines", str(options.num_engines),
                                     "--engine-num-threads", str(options.engine_threads),
                                     "--engine-per-token-delay-s", str(options.engine_per_token_delay_s),
                                     "--engine-device", options.engine_device,
                                     "--work-dir", str(work_dir / "engines"),
                                     "--own-router", str(options.auth).lower()),
        }
        started = {name: ManagedProcess(name, argv, logs / f"{name}.log",
                                        env={**_plugin_env(options), **token_dirs[name]}).start()
                   for name, argv in specs.items()}
        processes.extend(started.values())
        # the job records live in the stack's Redis: a trainer started again resumes its unfinished jobs
        ranks = trainer_ranks(options, ports, addr, logs, token_dirs["trainer"],
                              [*root_flags(options, work_dir)[0], "--jobs-redis-url", redis_url])
        started["trainer"] = ranks[0]
        processes.extend(p.start() for p in ranks)
        checks = {"buffer": _grpc_ready(addr["buffer"]), "reward": _grpc_ready(addr["reward"]),
                  "rollout": _grpc_ready(addr["rollout"]), "trainer": _grpc_ready(addr["trainer"])}
        for name, check in checks.items():
            started[name].wait_ready(check, timeout_s=options.start_timeout_s)
    except BaseException:
        for proc in reversed(processes):
            proc.stop()
        raise
    state = {
        "work_dir": str(work_dir), "redis_url": redis_url, "router_url": router_url,
        "buffer_addr": addr["buffer"], "reward_addr": addr["reward"], "reward_url": f"http://{addr['reward_rest']}",
        "rollout_addr": addr["rollout"], "trainer_addr": addr["trainer"],
        "trainer_url": f"http://{addr['trainer_rest']}",
        "processes": [_entry(p) for p in processes],
    }
    _write_state(work_dir, state)
    return state


def trainer_ranks(options: StackOptions, ports: dict[str, int], addr: dict[str, str],
                  logs: Path, token_env: dict[str, str] | None = None,
                  rank0_flags: list[str] | None = None) -> list[ManagedProcess]:
    """The trainer's ranks (not started): rank 0 serves the job API (with `rank0_flags`: its path roots and job
    records), ranks 1.. are workers; torchrun's env."""
    env = {"WORLD_SIZE": str(options.trainer_ranks), "MASTER_ADDR": HOST, "MASTER_PORT": str(free_port()),
           **({"CUDA_VISIBLE_DEVICES": ""} if options.trainer_device == "cpu" else {}),
           **_plugin_env(options), **(token_env or {})}
    flags = ["--buffer-addr", addr["buffer"], "--rollout-addr", addr["rollout"],
             "--num-threads", str(options.trainer_threads), "--device", options.trainer_device]
    rank0 = python_module("services.trainer", "--host", HOST, "--port", str(ports["trainer"]),
                          "--rest-port", str(ports["trainer_rest"]), *flags, *(rank0_flags or []))
    ranks = [ManagedProcess("trainer", rank0, logs / "trainer.log", env={**env, "RANK": "0", "LOCAL_RANK": "0"})]
    for rank in range(1, options.trainer_ranks):
        ranks.append(ManagedProcess(f"trainer-{rank}", python_module("services.trainer.ranks.worker", *flags),
                                    logs / f"trainer-{rank}.log",
                                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    return ranks


# The tokens each process of the stack holds: its own service's and those of the services it calls.
GRANTS = {"buffer": ("buffer",), "reward": ("reward",), "router": ("router",),
          "rollout": ("rollout", "buffer", "reward", "engine", "router"),
          "trainer": ("trainer", "buffer", "rollout", "engine"),
          "operator": ("trainer", "rollout", "buffer", "reward", "router")}  # the `physarum` commands of who ran `up`


def write_credentials(secrets_dir: Path) -> dict[str, dict[str, str]]:
    """Fresh tokens for this `up`, one directory per process holding only what GRANTS gives it; returns each
    process's environment (the directory's path: the tokens stay in files)."""
    from services.common import auth

    shutil.rmtree(secrets_dir, ignore_errors=True)
    issued = auth.write_tokens(secrets_dir / "issued")
    dirs = {name: auth.grant(secrets_dir / "issued", secrets_dir / name, services) for name, services in GRANTS.items()}
    for path in issued.values():
        path.unlink()  # no directory holds every token
    (secrets_dir / "issued").rmdir()
    return {name: {auth.TOKEN_DIR_ENV: str(path)} for name, path in dirs.items()}


def operator_token_dir(work_dir: Path = DEFAULT_WORK_DIR) -> Path:
    """Where `physarum` commands find the tokens the stack issued its operator (job API, manager, buffer, reward)."""
    return Path(work_dir).resolve() / "secrets" / "operator"


def _plugin_env(options: StackOptions) -> dict[str, str]:
    from services.common.plugins import ALLOWLIST_ENV

    return {} if options.plugin_allowlist is None else {ALLOWLIST_ENV: options.plugin_allowlist}


def _entry(proc: ManagedProcess) -> dict:
    return {"name": proc.name, "pid": proc.pid, "argv": proc.argv, "env": proc.env, "log": str(proc.log_path),
            "start_time": start_time(proc.pid)}


def is_trainer(entry: dict) -> bool:
    return entry["name"] == "trainer" or entry["name"].startswith("trainer-")


_is_trainer = is_trainer


def restart_trainer(work_dir: Path = DEFAULT_WORK_DIR, start_timeout_s: float = 180.0,
                    lock_held: bool = False) -> dict:
    """Stop the trainer's ranks that still run and start all of them again, on the same ports (after a crash:
    jobs resume from their checkpoints with `load`). Returns the updated state."""
    if not lock_held:
        with locked(work_dir):
            return restart_trainer(work_dir, start_timeout_s, lock_held=True)
    state = read_state(work_dir)
    if state is None:
        raise ValueError(f"restart_trainer: no stack in {work_dir}")
    entries = [e for e in state["processes"] if _is_trainer(e)]
    for entry in entries:
        _stop(entry, grace_s=10.0)
    ranks = [ManagedProcess(e["name"], e["argv"], Path(e["log"]), env=e.get("env", {})).start() for e in entries]
    ranks[0].wait_ready(_grpc_ready(state["trainer_addr"]), timeout_s=start_timeout_s)
    by_name = {p.name: _entry(p) for p in ranks}
    state["processes"] = [by_name.get(e["name"], e) for e in state["processes"]]
    _write_state(work_dir, state)
    return state


def _owned(entry: dict) -> bool:
    """The recorded process still runs: same PID and start time (sglang-router rewrites its command line, so the
    command line alone does not tell), or, for an entry without a start time, the same command line."""
    if entry.get("start_time") is not None:
        return start_time(entry["pid"]) == entry["start_time"]
    return cmdline_of(entry["pid"])[: len(entry["argv"])] == entry["argv"]


owned = _owned


def all_alive(state: dict) -> bool:
    return all(_owned(p) for p in state["processes"])


def down(work_dir: Path = DEFAULT_WORK_DIR, grace_s: float = 20.0) -> list[str]:
    """Stop the supervisor, then the processes recorded in stack.json, newest first, each by its PID; returns their
    names."""
    from services.common import weight_copies

    state = read_state(work_dir)
    if state is None:
        return []
    if state.get("supervisor"):  # first: it would start the others again
        _stop(state["supervisor"], grace_s)
    with locked(work_dir):
        stopped = [entry["name"] for entry in reversed(state["processes"]) if _stop(entry, grace_s)]
        stopped += stop_leftover_engines(Path(work_dir) / "engines", grace_s)  # a killed manager's
        (Path(work_dir) / STATE_FILE).unlink(missing_ok=True)
    weight_copies.remove_stale()  # a trainer that was killed left its copy of the weights
    return stopped


def _stop(entry: dict, grace_s: float) -> bool:
    """SIGTERM the recorded process if it is still ours, SIGKILL after grace_s; False if it was not running."""
    return terminate(entry["pid"], lambda: _owned(entry), grace_s) is not None


def _redis_ready(url: str):
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return lambda: redis_answers(parsed.hostname, parsed.port)


def _ready_check(state: dict, name: str):
    """How to tell that the recorded process `name` serves again (one that serves nothing: it runs)."""
    checks = {"redis": lambda: _redis_ready(state["redis_url"]),
              "sglang-router": lambda: _http_ready(f"{state['router_url']}/liveness"),
              "buffer": lambda: _grpc_ready(state["buffer_addr"]), "reward": lambda: _grpc_ready(state["reward_addr"]),
              "rollout": lambda: _grpc_ready(state["rollout_addr"])}
    return checks[name]() if name in checks else (lambda: True)


def restart(work_dir: Path = DEFAULT_WORK_DIR, name: str = "", start_timeout_s: float = 180.0,
            lock_held: bool = False) -> dict:
    """Start the recorded process `name` again with its command line and environment (same ports, same Redis
    directory, whose AOF it replays) after a crash; one still running is stopped first. Records the new PID and
    start time so `down` stops it; returns its new entry. The trainer's ranks restart together (restart_trainer).
    `lock_held`: the caller holds the work dir's lock."""
    if not lock_held:
        with locked(work_dir):
            return restart(work_dir, name, start_timeout_s, lock_held=True)
    state = read_state(work_dir)
    if state is None:
        raise ValueError(f"restart: no stack in {work_dir}")
    entry = next((e for e in state["processes"] if e["name"] == name), None)
    if entry is None:
        raise ValueError(f"restart: {work_dir}/{STATE_FILE} records no process {name!r} (it has "
                         f"{', '.join(e['name'] for e in state['processes'])})")
    if _is_trainer(entry):
        state = restart_trainer(work_dir, start_timeout_s, lock_held=True)
        return next(e for e in state["processes"] if e["name"] == name)
    _stop(entry, grace_s=10.0)
    proc = ManagedProcess(name, entry["argv"], Path(entry["log"]), env=entry.get("env", {})).start()
    try:
        proc.wait_ready(_ready_check(state, name), timeout_s=start_timeout_s)
    except BaseException:
        proc.stop()
        raise
    new = _entry(proc)
    state["processes"] = [new if e["name"] == name else e for e in state["processes"]]
    _write_state(work_dir, state)
    return new
