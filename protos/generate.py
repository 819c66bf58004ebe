"""Generate the Python gRPC code (with typed stubs) next to the .proto files.

    python -m protos.generate          # write protos/pagedserve/v1/*_pb2*.py(i)
    python -m protos.generate --check  # fail if the committed code differs from a fresh generation

protoc names imports after the proto path (`from pagedserve.v1 import common_pb2`); the
generated modules live in the `protos` package, so imports are rewritten to
`from protos.pagedserve.v1 import ...`. Nothing else in the generated text changes.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("pagedserve") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
_IMPORT_PATTERNS = [
    (re.compile(r"^from pagedserve\.v1 import ", re.M), "from protos.pagedserve.v1 import "),
    (re.compile(r"^import pagedserve\.v1\.", re.M), "import protos.pagedserve.v1."),
    (re.compile(r"(?<![\w.])pagedserve\.v1\.(\w+_pb2)\b"), r"protos.pagedserve.v1.\1"),
]


def _protoc(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / PACKAGE_DIR).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bin_dir = Path(sys.executable).parent  # mypy-protobuf's plugins sit beside the interpreter
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    for path in (out_dir / PACKAGE_DIR).iterdir():
        if path.name.endswith(GENERATED_SUFFIXES):
            text = path.read_text()
            for pattern, repl in _IMPORT_PATTERNS:
                text = pattern.sub(repl, text)
            path.write_text(text)


def _generated(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _protoc(out)
        fresh, committed = out / PACKAGE_DIR, ROOT / PACKAGE_DIR
        if args.check:
            names = _generated(fresh)
            stale = [
                n
                for n in names
                if not (committed / n).exists() or not filecmp.cmp(fresh / n, committed / n, shallow=False)
            ]
            extra = sorted(set(_generated(committed)) - set(names))
            if stale or extra:
                print(
                    f"generated gRPC code is out of date ({', '.join(stale + extra)}): run `make protos`",
                    file=sys.stderr,
                )
                return 1
            print(f"protos: {len(names)} generated files match the .proto sources")
            return 0
        for name in _generated(committed):
            (committed / name).unlink()
        for name in _generated(fresh):
            shutil.copyfile(fresh / name, committed / name)
        print(f"protos: wrote {len(_generated(fresh))} files to {committed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
