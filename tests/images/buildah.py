"""Run a command in a container of an image with buildah (daemonless, chroot isolation: the container shares this
machine's network, so services in separate containers meet on loopback as the local stack's processes do).

`buildah run` ignores an image's ENTRYPOINT and USER: the caller names the command, and the user is given as the
chart's pods run it (uid/gid 10001).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field

USER = "10001:10001"  # the images' user, the chart's runAsUser/runAsGroup


def buildah(*args: str, timeout_s: float = 600.0) -> str:  # waits out a build holding the storage lock
    result = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout_s)
    if result.returncode:
        raise RuntimeError(f"buildah {' '.join(args[:3])}: {result.stderr.strip()[-600:]}")
    return result.stdout.strip()


def image_exists(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True,
                          timeout=60).returncode == 0


def image_config(name: str) -> dict:
    """The image's OCI config (Entrypoint, Cmd, User, WorkingDir, Env); buildah 1.28 lacks --format's json."""
    return json.loads(buildah("inspect", "--type", "image", name))["OCIv1"]["config"]


@dataclass
class Container:
    """A working container of `image`; `argv` gives the `buildah run` command line of one process in it."""

    image: str
    name: str
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (host path, container path, read-only)
    created: bool = False

    def create(self) -> Container:
        subprocess.run(["buildah", "rm", self.name], capture_output=True, timeout=60)  # a leftover of a killed run
        buildah("from", "--name", self.name, self.image)
        self.created = True
        return self

    def argv(self, command: list[str], env: dict[str, str], workdir: str = "/app") -> list[str]:
        volumes = [arg for host, path, ro in self.mounts for arg in ("-v", f"{host}:{path}{':ro' if ro else ''}")]
        envs = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
        return ["buildah", "run", "--isolation", "chroot", "--user", USER, "--workingdir", workdir, *volumes, *envs,
                self.name, "--", *command]

    def run(self, command: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(command, env or {}), capture_output=True, text=True, timeout=timeout_s)

    def remove(self) -> None:
        if self.created:
            subprocess.run(["buildah", "rm", self.name], capture_output=True, timeout=120)
            self.created = False
