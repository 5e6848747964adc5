"""Everything README.md and docs/ name exists: each `python -m` module and `python` script, with the flags written after
it read from that program's own argparse parser; each flag written alone, known to one of Physarum's parsers, slime's
flag tables or a named outside program; each repository path; each relative link, with its anchor.

test_docs_commands.py checks `physarum` commands and `make` targets the same way. A moved module, a renamed flag or
a retitled section breaks a copied command or a link; this reads the docs as a user copies from them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from tests.unit.test_docs_commands import PHYSARUM, code_snippets, subcommands

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = re.compile(r"(?:^|[\s`(/])python3?\s+(?:-m\s+([A-Za-z_][\w.]*)|([\w./-]+\.py))")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*\*?)")
SEGMENTS = re.compile(r";|&&|\s\|\s")  # a pipe between commands, not bfloat16|float32
OUTSIDE_TOOLS = re.compile(r"(?:^|[\s`(])(helm|kubectl|docker|podman|buildah)\s")  # their flags are theirs to check
TOP = "services|tests|bench|scripts|examples|deploy|physarum|proto|compat|docs"  # the repository's folders
PATH = re.compile(rf"(?<![\w./-])((?:{TOP})/[^\s`'\",;:()\[\]]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INCLUDE = re.compile(r'^--8<-- "([^":]+):([\w-]+)"$', flags=re.M)

# Programs and flags of software Physarum drives but does not install or parse here, by whose they are.
OUTSIDE_PROGRAMS = {"sglang.launch_server": "SGLang's server, in SGLang's own image (GPU engines)"}
OUTSIDE_FLAGS = {
    "--tp-size": "SGLang's server", "--api-key": "SGLang's server", "--admin-api-key": "SGLang's server",
    "--enable-return-routed-experts": "SGLang's server",
    "--overlap-grad-reduce": "Megatron-LM's arguments (slime's training)",
    "--override-opt-param-scheduler": "Megatron-LM's arguments (slime's training)",
}

# Run in a child: each program as `python -m`/`python script` would, with argparse's parse_args stopping it at the
# parser, which is sent back; nothing past the parsing runs. Every program the docs name parses its arguments before
# it does any work (one without a parser would run, and fail the assertion below).
CAPTURE = r"""
import argparse, json, runpy, sys
class Parsed(BaseException):
    pass
def stop(self, *args, **kwargs):
    raise Parsed(self)
argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = stop
found = {}
for kind, name in json.loads(sys.argv[1]):
    sys.argv = [name]
    try:
        runpy.run_path(name, run_name="__main__") if kind == "script" else runpy.run_module(name, run_name="__main__")
        found[name] = None
    except Parsed as parsed:
        found[name] = sorted({opt for action in parsed.args[0]._actions for opt in action.option_strings})
print(json.dumps(found))
"""


def module_file(name: str) -> Path | None:
    """The source of module `name`: in the repository, else where it is installed (None: nowhere)."""
    for candidate in (ROOT / f"{name.replace('.', '/')}.py", ROOT / name.replace(".", "/") / "__main__.py"):
        if candidate.is_file():
            return candidate
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    return Path(spec.origin) if spec and spec.origin else None


def python_commands(text: str) -> list[tuple[str, str, str]]:
    """(kind, name, the rest of its segment) of each `python -m module` / `python script.py` in text's code."""
    found = []
    for snippet in code_snippets(text):
        for segment in SEGMENTS.split(snippet):
            for match in PYTHON.finditer(segment):
                if segment[match.end():match.end() + 1] == "<":  # python -m services.<name>: a pattern
                    continue
                module, script = match.groups()
                found.append(("module", module, segment[match.end():]) if module
                             else ("script", script, segment[match.end():]))
    return found


def program_file(kind: str, name: str) -> Path | None:
    if kind == "module":
        return module_file(name)
    return ROOT / name if (ROOT / name).is_file() else None


def makefile_programs() -> set[tuple[str, str]]:
    """The repository's programs the Makefile runs (`make chaos` -> tests.fuzz.chaos): flags of theirs may be named."""
    text = (ROOT / "Makefile").read_text()
    modules = {("module", name) for name in re.findall(r"(?:python\S*|\))\s+-m\s+([\w.]+)", text)}  # $$(...) -m x
    scripts = {("script", name) for name in re.findall(r"python\S*\s+([\w./-]+\.py)", text)}
    return {(kind, name) for kind, name in modules | scripts
            if (file := program_file(kind, name)) and ROOT in file.resolve().parents}  # not pytest, zipfile


@cache
def parsers() -> dict[str, set[str]]:
    """Each program the docs or the Makefile run (outside ones excepted): the option strings of its own parser."""
    programs = {(kind, name) for doc in DOCS for kind, name, _ in python_commands(doc.read_text())
                if name not in OUTSIDE_PROGRAMS} | makefile_programs()
    programs = {(kind, name) for kind, name in programs if program_file(kind, name)}  # a missing one: its own test
    result = subprocess.run([sys.executable, "-c", CAPTURE, json.dumps(sorted(programs))], cwd=ROOT,
                            capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, f"reading the programs' parsers failed:\n{result.stderr[-3000:]}"
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(found.values()), f"programs without an argparse parser: {[n for n, f in found.items() if not f]}"
    return {name: set(flags) for name, flags in found.items()}


@cache
def known_flags() -> set[str]:
    """Every flag a reader may meet alone: the CLI's, the programs', the services' (their config classes make their
    parsers), slime's and Megatron's as the flag tables list them, and the outside ones named above."""
    flags = {flag for options in subcommands().values() for flag in options}
    flags |= {flag for options in parsers().values() for flag in options}
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    config_table = importlib.util.module_from_spec(spec)
    sys.modules["config_table"] = config_table
    spec.loader.exec_module(config_table)
    flags |= {row[1].strip("`") for service in config_table.discover() for row in config_table.rows(service)}
    from services.trainer.slime_flags.flags import FLAGS
    from services.trainer.slime_flags.lora_flags import LORA_FLAGS
    from services.trainer.slime_flags.megatron_flags import ARCH, MEGATRON

    flags |= {f"--{name}" for name in [*FLAGS, *LORA_FLAGS, *ARCH, *MEGATRON]}
    return flags | set(OUTSIDE_FLAGS)


def lone_flags(snippet: str) -> list[str]:
    """Flags of a code snippet not written after a command (whose own checks cover them) or an outside tool."""
    found = []
    for segment in SEGMENTS.split(snippet):
        starts = [m.start() for pattern in (PYTHON, PHYSARUM, OUTSIDE_TOOLS) for m in [pattern.search(segment)] if m]
        found += FLAG.findall(segment[:min(starts)] if starts else segment)
    return found


def is_known(flag: str, known: set[str]) -> bool:
    """`--fp8-*` is known when some flag starts with `--fp8-`."""
    return any(k.startswith(flag[:-1]) for k in known) if flag.endswith("*") else flag in known


def expanded(doc: Path) -> str:
    """The doc's text with its README includes (`--8<-- "README.md:demo"`) in place, as mkdocs renders it."""
    def section(match: re.Match) -> str:
        source = (ROOT / match.group(1)).read_text()
        start, end = f"<!-- --8<-- [start:{match.group(2)}] -->", f"<!-- --8<-- [end:{match.group(2)}] -->"
        assert start in source and end in source, f"{doc.name} includes {match.group(0)}, which has no such section"
        return source.split(start, 1)[1].split(end, 1)[0]
    return INCLUDE.sub(section, doc.read_text())


def anchors(doc: Path) -> set[str]:
    """The ids of the doc's headings, as the toc extension (mkdocs) and GitHub make them from plain titles."""
    text = re.sub(r"```.*?```", "", expanded(doc), flags=re.S)
    ids: set[str] = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        slug = slugify(re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", title), "-")
        ids.add(slug if slug not in ids else next(f"{slug}_{n}" for n in range(1, 99) if f"{slug}_{n}" not in ids))
    return ids


def prose(text: str) -> str:
    """The text without code, where a link is a link."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_commands_exist_with_their_flags(doc: Path) -> None:
    wrong = []
    for kind, name, rest in python_commands(doc.read_text()):
        if name in OUTSIDE_PROGRAMS:
            continue
        if not program_file(kind, name):
            wrong.append(f"`python {'-m ' if kind == 'module' else ''}{name}`: no such {kind}")
            continue
        wrong += [f"`{name} {flag}`: no such flag" for flag in FLAG.findall(rest) if flag not in parsers()[name]]
    assert not wrong, f"{doc.relative_to(ROOT)} names programs or flags that do not exist: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_flags_named_alone_exist(doc: Path) -> None:
    known = known_flags()
    wrong = sorted({flag for snippet in code_snippets(doc.read_text()) for flag in lone_flags(snippet)
                    if not is_known(flag, known)})
    assert not wrong, f"{doc.relative_to(ROOT)} names flags no parser, flag table or outside program has: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_exist(doc: Path) -> None:
    paths = {p.rstrip(".") for p in PATH.findall(doc.read_text()) if not re.search(r"[*<>{}$]", p)}
    wrong = sorted(p for p in paths if not (ROOT / p.split("#")[0]).exists())
    assert not wrong, f"{doc.relative_to(ROOT)} names paths that are not in the repository: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_anchors_exist(doc: Path) -> None:
    wrong = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            wrong.append(f"{target}: no such file")
        elif doc.parent == ROOT / "docs" and file.parent != doc.parent:
            wrong.append(f"{target}: outside docs/, where the site cannot serve it (name the path in code instead)")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            wrong.append(f"{target}: {file.name} has no heading #{anchor}")
    assert not wrong, f"{doc.relative_to(ROOT)} has broken links: {wrong}"


def test_the_checks_can_fail() -> None:
    """A made-up module, flag, path and anchor are each caught."""
    assert module_file("services.trainer.no_such_module") is None
    assert not is_known("--no-such-flag", known_flags()) and is_known("--fp8-*", known_flags())
    assert "--seed" in parsers()["physarum.demo"] and "--no-such-flag" not in parsers()["physarum.demo"]
    assert lone_flags("--use-opd; physarum up --bogus") == ["--use-opd"]  # the second is test_docs_commands'
    assert lone_flags("--fp8-* helm install --create-namespace") == ["--fp8-*"]
    assert PATH.findall("see `bench/no_such_bench.py`") == ["bench/no_such_bench.py"]
    assert "jobs-outlive-the-trainer" in anchors(ROOT / "docs" / "kubernetes.md")
    assert "the-demo" in anchors(ROOT / "docs" / "index.md")  # a heading included from the README
    assert "no-such-heading" not in anchors(ROOT / "docs" / "kubernetes.md")
