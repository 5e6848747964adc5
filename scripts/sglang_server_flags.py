"""Write tests/data/sglang_server_flags.json: every flag of SGLang's `launch_server`, read from an sglang wheel's
`sglang/srt/server_args.py` without importing it (SGLang needs CUDA kernels to import).

SGLang declares most flags as annotated `ServerArgs` fields (`A[type, "help"]` or `A[type, Arg(...)]`: the flag is
`--field-name` unless `Arg(cli_name=...)`, plus `Arg(aliases=[...])`; `Arg(no_cli=True)` has none) and registers the
rest with `parser.add_argument("--flag", ...)`. Both are read here.

    pip download --no-deps sglang==VERSION -d /tmp/sgl
    .venv/bin/python scripts/sglang_server_flags.py /tmp/sgl/sglang-VERSION-*.whl
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "sglang_server_flags.json"
SOURCE = "sglang/srt/server_args.py"


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def field_flags(field: ast.AnnAssign) -> list[str]:
    """The flags of one annotated ServerArgs field, or none when it has no CLI metadata."""
    annotation = field.annotation
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple)):
        return []
    metadata = annotation.slice.elts[1:]
    default = "--" + field.target.id.replace("_", "-")
    for item in metadata:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            return [default]
        if isinstance(item, ast.Call) and getattr(item.func, "id", "") == "Arg":
            no_cli = _keyword(item, "no_cli")
            if isinstance(no_cli, ast.Constant) and no_cli.value:
                return []
            cli_name = _keyword(item, "cli_name")
            aliases = _keyword(item, "aliases")
            names = [cli_name.value if isinstance(cli_name, ast.Constant) else default]
            if isinstance(aliases, ast.List | ast.Tuple):
                names += [a.value for a in aliases.elts if isinstance(a, ast.Constant)]
            return names
    return []


def server_flags(source: str) -> list[str]:
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
    flags = {flag for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
             for flag in field_flags(node)}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
            flags |= {a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return sorted(flags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path, help="an sglang wheel (pip download --no-deps sglang==VERSION)")
    args = parser.parse_args(argv)
    version = re.match(r"sglang-([^-]+)-", args.wheel.name).group(1)
    with zipfile.ZipFile(args.wheel) as wheel:
        flags = server_flags(wheel.read(SOURCE).decode())
    OUT.write_text(json.dumps({"sglang_version": version, "source": f"{SOURCE} of the sglang {version} wheel",
                               "flags": flags}, indent=0) + "\n")
    print(f"{len(flags)} flags of sglang {version} -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
