"""A private multi-"host" network for tests and benchmarks: one network namespace per pod, joined by a bridge in a
switch namespace.

Each pod gets a veth named eth0 with an address in 10.200.0.0/24, which exists only inside these namespaces (no
default route, nothing in the root namespace), and a hosts file with headless-Service-style names, bind-mounted over
/etc/hosts in the process's own mount namespace. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from services.common import procs

SUBNET = "10.200.0"  # /24; never routed outside the namespaces made here
SWITCH_IFNAME = "br0"
HOSTS_MOUNT = 'mount --bind "$0" /etc/hosts && exec "$@"'  # `ip netns exec` has already unshared the mount ns


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS...` (with a timeout); raises RuntimeError with ip's message on failure when check is set."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (not root, no iproute2, no permission), or None if they can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (ip comes with iproute2)"
    probe = f"physarum-probe-{os.getpid()}"
    result = ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Pod:
    """One "pod": its namespace, eth0 address, DNS name and the switch-side end of its veth."""

    name: str
    netns: str
    address: str
    hostname: str
    switch_port: str


@dataclass
class Network:
    """Pods on one bridge. create() builds it, teardown() removes every namespace (and so every veth and bridge)."""

    prefix: str
    work_dir: Path
    domain: str = "default.svc.cluster.local"
    pods: dict[str, Pod] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def hosts_file(self) -> Path:
        return self.work_dir / "hosts"

    def create(self, pod_names: list[tuple[str, str]]) -> Network:
        """Pods from (pod name, headless Service name) pairs, e.g. ("physarum-trainer-0", "physarum-trainer")."""
        if len(pod_names) > 240:
            raise ValueError(f"at most 240 pods fit in {SUBNET}.0/24, got {len(pod_names)}")
        self._add_netns(self.switch)
        ip("-n", self.switch, "link", "add", SWITCH_IFNAME, "type", "bridge")
        ip("-n", self.switch, "link", "set", SWITCH_IFNAME, "up")
        lines = ["127.0.0.1 localhost"]
        for i, (name, service) in enumerate(pod_names):
            pod = Pod(name, f"{self.prefix}-{name}", f"{SUBNET}.{10 + i}", f"{name}.{service}.{self.domain}",
                      f"p{i}")
            self._add_netns(pod.netns)
            ip("-n", self.switch, "link", "add", pod.switch_port, "type", "veth", "peer", "name", "eth0", "netns",
               pod.netns)
            ip("-n", self.switch, "link", "set", pod.switch_port, "master", SWITCH_IFNAME, "up")
            ip("-n", pod.netns, "addr", "add", f"{pod.address}/24", "dev", "eth0")
            ip("-n", pod.netns, "link", "set", "eth0", "up")
            self.pods[name] = pod
            short = pod.hostname.removesuffix(".cluster.local")
            lines.append(f"{pod.address} {pod.hostname} {short} {name}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("\n".join(lines) + "\n")
        return self

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def exec_argv(self, pod: str, argv: list[str]) -> list[str]:
        """argv run inside `pod`'s namespace with the network's hosts file as its /etc/hosts."""
        return ["ip", "netns", "exec", self.pods[pod].netns, "sh", "-c", HOSTS_MOUNT, str(self.hosts_file), *argv]

    def set_link(self, pod: str, up: bool) -> None:
        """Plug or unplug `pod`'s cable: its veth's switch-side end goes up or down."""
        ip("-n", self.switch, "link", "set", self.pods[pod].switch_port, "up" if up else "down")

    def teardown(self) -> list[str]:
        """Delete every namespace made (pods first); returns the errors, if any. Stop the pods' processes first."""
        errors = []
        for name in reversed(self.namespaces):
            result = ip("netns", "del", name, check=False)
            if result.returncode != 0:
                errors.append(f"ip netns del {name}: {result.stderr.strip()}")
        self.namespaces.clear()
        return errors


def existing_namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


@dataclass
class PodProcess(procs.ManagedProcess):
    """A ManagedProcess started through `ip netns exec ... sh -c 'mount ...; exec ...'`.

    Both wrappers exec, so the PID stays the same while /proc/PID/cmdline shrinks to a suffix of argv: that suffix
    is what owns_pid() accepts. With interactive set, stdin and stdout are pipes (stderr goes to the log).
    """

    interactive: bool = False

    def start(self) -> PodProcess:
        if not self.interactive:
            super().start()
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                          start_new_session=True)
        return self

    def owns_pid(self) -> bool:
        cmdline = procs.cmdline_of(self.pid) if self.alive() else []
        return bool(cmdline) and self.argv[-len(cmdline):] == cmdline

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.popen is not None and self.popen.stdin is not None:
            self.popen.stdin.close()
        code = super().stop(grace_s)
        if self.popen is not None and self.popen.stdout is not None:
            self.popen.stdout.close()
        return code
