"""Generate the Python gRPC stubs of proto/physarum/v1 into services/common/gen (run by `make proto`).

grpc_tools writes `from physarum.v1 import x_pb2`; the stubs live inside the services.common package,
so those imports are rewritten to absolute package paths.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT.parent / "services" / "common" / "gen"
IMPORT_RE = re.compile(r"^from physarum\.v1 import", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "physarum" / "v1").glob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")
    written = []
    for package_dir in (out_dir, out_dir / "physarum", out_dir / "physarum" / "v1"):
        init = package_dir / "__init__.py"
        init.touch()
        written.append(init)
    for path in sorted((out_dir / "physarum" / "v1").glob("*_pb2*.py*")):
        path.write_text(IMPORT_RE.sub("from services.common.gen.physarum.v1 import", path.read_text()))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out.parent) if path.is_relative_to(args.out.parent) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
