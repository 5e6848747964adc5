"""The docs name only commands that exist: every `physarum <command> --flag` and `make <target>` written in the README,
docs/ and the chart's README is checked against the CLI's own parser and the Makefile's rules.

Docs drift when a flag is renamed or never built (a note once told users of `physarum scale --add-url`, which no
version had); this reads the code spans and code blocks the way a user would copy them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from physarum.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("README.md")])
PHYSARUM = re.compile(r"(?:^|[\s/`(])physarum\s+([a-z][a-z-]*)([^`\n]*)")
MAKE = re.compile(r"(?:^|[\s`(])make\s+([a-z][a-z0-9-]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def code_snippets(text: str) -> list[str]:
    """The text of every fenced code block line and every inline code span."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return [line for block in fenced for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", rest)


def subcommands() -> dict[str, set[str]]:
    """Each physarum subcommand's option strings, plus the global ones."""
    parser = build_parser()
    global_flags = {opt for action in parser._actions for opt in action.option_strings}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: global_flags | {opt for action in p._actions for opt in action.option_strings}
            for name, p in sub.choices.items()}


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, flags=re.M))


def test_snippets_are_found() -> None:
    """The scan itself works: the README's quick start is seen."""
    snippets = [s for doc in DOCS for s in code_snippets(doc.read_text())]
    assert any(PHYSARUM.search(s) for s in snippets) and any(MAKE.search(s) for s in snippets)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_physarum_commands_exist(doc: Path) -> None:
    commands = subcommands()
    wrong = []
    for snippet in code_snippets(doc.read_text()):
        for match in PHYSARUM.finditer(snippet):
            name, rest = match.group(1), match.group(2)
            if name not in commands:
                wrong.append(f"`physarum {name}`: no such command (there are {sorted(commands)})")
                continue
            # flags up to the next command on the line (`;`, `&&`, `|`)
            rest = re.split(r"[;|]|&&", rest)[0]
            wrong += [f"`physarum {name} {flag}`: no such flag" for flag in FLAG.findall(rest)
                      if flag not in commands[name]]
    assert not wrong, f"{doc.relative_to(ROOT)} names what the CLI lacks: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_make_targets_exist(doc: Path) -> None:
    targets = make_targets()
    wrong = sorted({name for snippet in code_snippets(doc.read_text())
                    for name in MAKE.findall(snippet) if name not in targets})
    assert not wrong, f"{doc.relative_to(ROOT)} names make targets the Makefile lacks: {wrong}"


def test_a_made_up_flag_is_caught() -> None:
    """The check can fail: a flag the parser lacks is reported."""
    commands = subcommands()
    rest = PHYSARUM.search("`physarum scale --add-url http://x`").group(2)
    assert [f for f in FLAG.findall(rest) if f not in commands["scale"]] == ["--add-url"]
