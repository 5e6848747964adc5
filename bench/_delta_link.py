"""The delta half of bench/weight_sync.py: full against delta weight sync of a bf16 model over a 1 Gbit/s link.

The trainer and one CPU engine (serving bf16) each run in a network namespace of their own, joined by a bridge,
both ends of the link shaped by `tc` to 1 Gbit/s. The trainer's fp32 master weights are a ~220 MB (bf16) tiny Qwen3
before and after one AdamW step at lr 1e-6 on a random batch. Each round, `DeltaBroadcaster` sends one version in
full (its delta base forgotten), then the other as an xor delta, then the first as an overwrite delta; each includes
casting to bf16, and a delta its encoding and the engine's decoding and checksums (xxh3-128). Needs root (network
namespaces); run through bench/weight_sync.py, `--trainer` is the trainer pod's side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINK_RATE = "1gbit"
LR = 1e-6
ENGINE_PORT = 30000
TIMEOUT_S = 300.0
ENCODINGS = ("xor", "overwrite")


def build_model(work: Path) -> Path:
    """28 layers, 512 wide: 110 M parameters, 220 MB in bf16."""
    from physarum import tasks, tinymodel

    return tinymodel.build_tiny_model(work / "delta-model", tasks.corpus(), num_layers=28, hidden_size=512)


def adamw_step(model_dir: Path, work: Path) -> tuple[Path, Path]:
    """The master weights (fp32) before and after one AdamW step at lr 1e-6 on a random batch, as two files."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.checkpoint import safetensors_io

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def weights() -> list:
        seen, out = set(), []
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() not in seen:  # the tied lm_head is the embedding
                seen.add(tensor.data_ptr())
                out.append((name, tensor.detach().clone().contiguous()))
        return out

    before, after = work / "before.safetensors", work / "after.safetensors"
    safetensors_io.write(before, weights())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    safetensors_io.write(after, weights())
    return before, after


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds a process has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(url: str) -> None:
    """Until the engine answers /health (at most TIMEOUT_S)."""
    import httpx

    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine {url}: no /health in {TIMEOUT_S} s")
        time.sleep(0.5)


def trainer(url: str, master_address: str, before: str, after: str, rounds: int, engine_pid: int) -> dict:
    """In the trainer's pod: alternate full and delta syncs of the two versions; the best time of each."""
    from safetensors.torch import load_file

    from services.trainer.settings.weight_sync import DeltaSettings
    from services.trainer.weight_sync.delta_push import DeltaBroadcaster

    # in memory, as a trainer's weights are (a mapped file would fault its pages in during the first sync)
    versions = [[(k, v.clone()) for k, v in sorted(load_file(path).items())] for path in (before, after)]
    wait_healthy(url)
    result: dict = {"full_seconds": [], **{f"{enc}_seconds": [] for enc in ENCODINGS}}
    with DeltaBroadcaster([url], master_address=master_address, timeout_s=TIMEOUT_S) as sync:
        sync.broadcast(versions[0], "warmup")  # joins the group, first full copy
        for i in range(rounds):  # full a, then a -> b as xor, then b -> a as overwrite (the same elements change)
            sync.tracker.reset()
            for step, mode in enumerate(("full", *ENCODINGS)):
                if mode in ENCODINGS:
                    sync.tracker.settings = DeltaSettings(mode, "xxh3-128")
                cpu = cpu_seconds("self") + cpu_seconds(engine_pid)
                start = time.perf_counter()
                stats = sync.broadcast(versions[(i + step) % 2], f"{mode}-{i}")
                seconds = time.perf_counter() - start
                if seconds < min(result[f"{mode}_seconds"], default=float("inf")):  # the fastest round's phases
                    result[f"{mode}_phases"] = [stats["stage_seconds"], stats.get("encode_seconds", 0.0)]
                    result[f"{mode}_cpu_seconds"] = cpu_seconds("self") + cpu_seconds(engine_pid) - cpu
                result[f"{mode}_seconds"].append(seconds)
                assert stats["mode"] == ("full" if mode == "full" else "delta") and not stats["repaired"], stats
                result[f"{mode}_bytes"] = stats["bytes"]
                result["changed_fraction"] = stats["changed_fraction"]
    return result


def measure(work: Path, rounds: int) -> dict:
    """Start the two pods, run the trainer's rounds; its figures, or {"skipped": reason} where there is no netns."""
    from testkit import netns

    reason = netns.unavailable_reason()
    if reason:
        return {"skipped": f"network namespaces: {reason}"}
    start = time.monotonic()
    model = build_model(work)
    before, after = adamw_step(model, work)
    print(f"delta bench: model and AdamW step in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return over_link(work, model, [], __file__, [str(before), str(after), str(rounds)])


def over_link(work: Path, model: Path, engine_args: list[str], script: str, trainer_args: list[str]) -> dict:
    """One CPU engine (bf16, plus `engine_args`) serving `model` and `script --trainer URL ADDRESS
    *trainer_args ENGINE_PID OUT` in two network namespaces over the shaped link; the JSON the trainer wrote."""
    from services.common import procs
    from testkit import netns

    net = netns.Network(f"pxd{os.getpid()}", work / "netns").create(
        [("trainer-0", "trainer"), ("engine-0", "engine")])
    started: list[procs.ManagedProcess] = []
    try:
        for pod in net.pods.values():  # both directions of the link at 1 Gbit/s
            subprocess.run(["ip", "netns", "exec", pod.netns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                            "rate", LINK_RATE, "burst", "256kb", "latency", "100ms"], check=True, timeout=10)
        env = {"GLOO_SOCKET_IFNAME": "eth0"}
        engine = net.pods["engine-0"]
        argv = [sys.executable, "-m", "services.engine", "--host", engine.address, "--port", str(ENGINE_PORT),
                "--model-path", str(model), "--dtype", "bfloat16", "--num-threads", "1",
                "--weight-sync-timeout-s", str(TIMEOUT_S), *engine_args]
        logs = Path(script).stem  # the delta and the LoRA halves each leave their own logs
        engine_proc = netns.PodProcess("engine", net.exec_argv("engine-0", argv), work / f"{logs}-engine.log",
                                       env=env).start()
        started.append(engine_proc)
        out = work / f"{logs}-trainer.json"
        argv = [sys.executable, script, "--trainer", f"http://{engine.hostname}:{ENGINE_PORT}",
                net.pods["trainer-0"].hostname, *trainer_args, str(engine_proc.pid), str(out)]
        trainer_proc = netns.PodProcess("trainer", net.exec_argv("trainer-0", argv), work / f"{logs}-trainer.log",
                                        env=env).start()
        started.append(trainer_proc)
        code = trainer_proc.popen.wait(timeout=TIMEOUT_S * 2)
        if code != 0:
            raise RuntimeError(f"trainer pod exited {code}; log {trainer_proc.log_path}:\n{trainer_proc.log_tail()}")
        return json.loads(out.read_text())
    finally:
        for proc in reversed(started):
            proc.stop()
        net.teardown()


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--trainer":
        import logging

        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
        import torch

        torch.set_num_threads(1)  # as the other sync benchmarks: torch's threads spin against each other when loaded
        url, address, before_path, after_path, num_rounds, engine_pid, out_path = sys.argv[2:9]
        figures = trainer(url, address, before_path, after_path, int(num_rounds), int(engine_pid))
        Path(out_path).write_text(json.dumps(figures))
        sys.exit(0)
    sys.exit("run through bench/weight_sync.py")
